#!/usr/bin/env bash
# Two server builds side by side in one device call: each load row runs
# against build A, then B, then A and B again (alternated, so drift in the
# machine's clocks shows as A/A and B/B spread), one fresh server per run.
# Over a bundle holding both servers and one client:
#   scripts/bundle.sh .device/bundle build/server/mlaverify-server build/client/mlaverify-client
#   cp OLD_SERVER .device/bundle/bin/mlaverify-server-a   (its libraries: bundle it too)
#   OUT=/tmp/out bench/server_ab.sh [A_BINARY] [B_BINARY]   → $OUT/server-ab.txt
# A defaults to $bundle/bin/mlaverify-server-a, B to $bundle/bin/mlaverify-server.
# Rows: one call in flight at L=16K over CUDA shm, system shm and inline, and
# 64 streams at L=1K over CUDA shm and inline (VerifyStream, 16 drafts, 8 heads).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
a=${1:-$bundle/bin/mlaverify-server-a}
b=${2:-$bundle/bin/mlaverify-server}
out=${OUT:-/tmp/mlaverify-server-ab}
mkdir -p "$out"
client=$bundle/bin/mlaverify-client
c1=(--concurrency 1 --duration-s 4 --warmup-s 1 --prompt-len 16384 --max-seq-len 16900)
c64=(--concurrency 64 --duration-s 5 --warmup-s 1.5 --prompt-len 1024)

row() {  # row BINARY TAG LOAD_ARGS...: one server, one load row, its summary lines
  local bin=$1 tag=$2
  shift 2
  rm -f "$out/ports"
  "$bin" --listen 127.0.0.1:0 --admin-port -1 --port-file "$out/ports" --backend cuda \
    --layers 61 --page-size 64 --devices 0 --heads 8 --pool-bytes 40GiB --allow-client-shm true \
    > "$out/server-$tag.log" 2>&1 &
  local spid=$!
  for _ in $(seq 1 600); do [ -s "$out/ports" ] && break; sleep 0.1; done
  local port
  read -r port _ < "$out/ports"
  for _ in $(seq 1 1200); do
    "$client" --target "127.0.0.1:$port" health > /dev/null 2>&1 && break
    sleep 0.1
  done
  timeout 90 "$client" --target "127.0.0.1:$port" load --stream --drafts 16 --progress false "$@" \
    > "$out/load-$tag.log" 2>&1
  local rc=$?
  kill -TERM "$spid"
  wait "$spid"
  printf '%-28s rc=%d  %s | %s\n' "$tag" "$rc" \
    "$(grep -E '^latency' "$out/load-$tag.log" | awk '{print "p50", $4, "p99", $8}')" \
    "$(grep -E '^verify calls' "$out/load-$tag.log" | grep -o '([0-9.]* calls/s')"
}

{
  for round in 1 2; do
    row "$a" "A-cuda-shm-c1-16k-$round" "${c1[@]}" --data-plane cuda-shm
    row "$b" "B-cuda-shm-c1-16k-$round" "${c1[@]}" --data-plane cuda-shm
    row "$a" "A-shm-c1-16k-$round" "${c1[@]}" --data-plane shm --shm-staging-mib 1200
    row "$b" "B-shm-c1-16k-$round" "${c1[@]}" --data-plane shm --shm-staging-mib 1200
    row "$a" "A-inline-c1-16k-$round" "${c1[@]}"
    row "$b" "B-inline-c1-16k-$round" "${c1[@]}"
    row "$a" "A-cuda-shm-c64-1k-$round" "${c64[@]}" --data-plane cuda-shm
    row "$b" "B-cuda-shm-c64-1k-$round" "${c64[@]}" --data-plane cuda-shm
    row "$a" "A-inline-c64-1k-$round" "${c64[@]}"
    row "$b" "B-inline-c64-1k-$round" "${c64[@]}"
  done
} | tee "$out/server-ab.txt"
