#!/usr/bin/env bash
# The Python client's per-layer Verify latency next to the C++ client's, on
# this host against the CPU backend: a short prompt keeps the server's own
# time small, so the difference is the clients'. One server, the clients
# alternating per row (plane:mode), one call in flight, as the pyclient part
# of bench/gpu_run.sh does on the GPU: the C++ client (mlaverify-client
# load), the pure-Python path and, for the shm plane, the native path
# (--native) when build/client/python/mlaverify/lib/libmlaverify_native.so is
# there; then bench/python_client_parts.py: each part of one call alone.
#   bench/python_client_cpu.sh [BUILD_DIR] [OUT_DIR]
# Env: ROWS ("shm:stream shm:unary inline:stream inline:unary"), PROMPT_LEN
# (64), DRAFTS (1: the CPU backend takes ~11 ms for N=16 here), LAYERS (8), DURATION_S (5).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(realpath "${1:-build}")
out=${2:-$(mktemp -d /tmp/pyclient-cpu.XXXX)}
mkdir -p "$out"
rm -f "$out/ports"
read -r -a rows <<< "${ROWS:-shm:stream shm:unary inline:stream inline:unary}"
prompt=${PROMPT_LEN:-64} drafts=${DRAFTS:-1} dur=${DURATION_S:-5}
"$build/server/mlaverify-server" --backend cpu --layers "${LAYERS:-8}" --heads 8 \
  --listen 127.0.0.1:0 --admin-port -1 --port-file "$out/ports" --allow-client-shm true \
  --cpu-threads 1 --slow-call-ms 0 --draft-buckets "$drafts" --batch-buckets 1 \
  --drain-grace-s 0 > "$out/server.log" 2>&1 &
spid=$!
trap 'kill -TERM $spid 2>/dev/null; wait $spid 2>/dev/null' EXIT
for _ in $(seq 1 300); do [ -s "$out/ports" ] && break; sleep 0.1; done
read -r gport _ < "$out/ports"
target=127.0.0.1:$gport
for row in "${rows[@]}"; do
  plane=${row%%:*} mode=${row#*:} stream=()
  [ "$mode" = stream ] && stream=(--stream)
  "$build/client/mlaverify-client" --target "$target" load --concurrency 1 --duration-s "$dur" \
    --warmup-s 1 --prompt-len "$prompt" --drafts "$drafts" --progress false "${stream[@]}" \
    --data-plane "$plane" --json "$out/cpp-$plane-$mode.json" > "$out/cpp-$plane-$mode.log" 2>&1
  PYTHONPATH=$build/client/python /usr/bin/python3 bench/python_client_latency.py \
    --target "$target" --plane "$plane" --prompt-len "$prompt" --drafts "$drafts" "${stream[@]}" \
    --duration-s "$dur" --warmup-s 1 --json "$out/py-$plane-$mode.json" \
    > "$out/py-$plane-$mode.log" 2>&1
  if [ "$plane" != inline ]; then
    PYTHONPATH=$build/client/python /usr/bin/python3 bench/python_client_latency.py --native \
      --target "$target" --plane "$plane" --prompt-len "$prompt" --drafts "$drafts" \
      "${stream[@]}" --duration-s "$dur" --warmup-s 1 --json "$out/native-$plane-$mode.json" \
      > "$out/native-$plane-$mode.log" 2>&1 || true
  fi
  /usr/bin/python3 bench/pyclient_rows.py "$row" "$out/cpp-$plane-$mode.json" \
    "$out/py-$plane-$mode.json" "$out/native-$plane-$mode.json"
done
# Then each part of one call alone (bench/python_client_parts.py).
PYTHONPATH=$build/client/python /usr/bin/python3 bench/python_client_parts.py --target "$target" \
  --drafts "$drafts" | tee "$out/parts.txt"
echo "logs and JSON: $out"
