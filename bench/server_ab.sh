#!/usr/bin/env bash
# Server builds side by side in one device call: each load row runs against
# every build in turn, round after round (alternated, so drift in the
# machine's clocks shows as spread within a build), one fresh server per run.
# Over a bundle holding the servers and one client:
#   scripts/bundle.sh .device/bundle build/server/mlaverify-server build/client/mlaverify-client OTHER...
#   OUT=/tmp/out bench/server_ab.sh [BINARY...]   → $OUT/server-ab.txt
# Builds are labelled A, B, C... in the order given; default: A =
# $bundle/bin/mlaverify-server-a, B = $bundle/bin/mlaverify-server.
# AB_ROUNDS (default 2) rounds; AB_ROWS (default all) a subset of: cuda-shm-c1
# shm-c1 inline-c1 cuda-shm-c64 inline-c64 (one call in flight at L=16K, 64
# streams at L=1K; VerifyStream, 16 drafts, 8 heads). Each line: latency,
# calls/s, the server's split (in the server = queued + device + rest, µs per
# call) and the server's minor page faults over the row. AB_BACKEND=cpu: the
# CPU backend with small sequences (below), on a machine without a GPU.
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
if [ $# -gt 0 ]; then bins=("$@"); else bins=("$bundle/bin/mlaverify-server-a" "$bundle/bin/mlaverify-server"); fi
rounds=${AB_ROUNDS:-2}
read -r -a rows <<< "${AB_ROWS:-cuda-shm-c1 shm-c1 inline-c1 cuda-shm-c64 inline-c64}"
out=${OUT:-/tmp/mlaverify-server-ab}
mkdir -p "$out"
client=$bundle/bin/mlaverify-client
c1=(--concurrency 1 --duration-s 4 --warmup-s 1 --prompt-len 16384 --max-seq-len 16900)
c64=(--concurrency 64 --duration-s 5 --warmup-s 1.5 --prompt-len 1024)
server=(--backend cuda --layers 61 --devices 0 --pool-bytes 40GiB)
if [ "${AB_BACKEND:-cuda}" = cpu ]; then
  # The CPU backend, for the service's own per-call work: the same message
  # sizes (8 heads, N=16) over sequences kept short (1 prompt token,
  # replaced past 40), so that the CPU reference's attention stays about a
  # millisecond per call; 16 streams instead of 64.
  c1=(--concurrency 1 --duration-s 4 --warmup-s 1 --prompt-len 1 --max-seq-len 40)
  c64=(--concurrency 16 --duration-s 4 --warmup-s 1 --prompt-len 1 --max-seq-len 40)
  server=(--backend cpu --layers 2 --cpu-threads 1 --pool-bytes 256MiB)
fi

row() {  # row BINARY TAG LOAD_ARGS...: one server, one load row, its summary lines
  local bin=$1 tag=$2
  shift 2
  rm -f "$out/ports"
  "$bin" --listen 127.0.0.1:0 --admin-port -1 --port-file "$out/ports" "${server[@]}" \
    --page-size 64 --heads 8 --allow-client-shm true > "$out/server-$tag.log" 2>&1 &
  local spid=$!
  for _ in $(seq 1 600); do [ -s "$out/ports" ] && break; sleep 0.1; done
  local port
  read -r port _ < "$out/ports"
  for _ in $(seq 1 1200); do
    "$client" --target "127.0.0.1:$port" health > /dev/null 2>&1 && break
    sleep 0.1
  done
  # The server's minor page faults over the load (field 10 of its stat).
  local faults0 faults1
  faults0=$(awk '{print $10}' "/proc/$spid/stat")
  timeout 90 "$client" --target "127.0.0.1:$port" load --stream --drafts 16 --progress false "$@" \
    > "$out/load-$tag.log" 2>&1
  local rc=$?
  faults1=$(awk '{print $10}' "/proc/$spid/stat")
  kill -TERM "$spid"
  wait "$spid"
  printf '%-28s rc=%d  %s | %s | server us %s | %d faults\n' "$tag" "$rc" \
    "$(grep -E '^latency' "$out/load-$tag.log" | awk '{print "p50", $4, "p99", $8}')" \
    "$(grep -E '^verify calls' "$out/load-$tag.log" | grep -o '([0-9.]* calls/s')" \
    "$(grep -E '^server split' "$out/load-$tag.log" | sed 's/.*mean us: //')" \
    "$((faults1 - faults0))"
}

row_args() {  # row_args ROW: sets $args, the load flags of that row
  case $1 in
    cuda-shm-c1) args=("${c1[@]}" --data-plane cuda-shm) ;;
    shm-c1) args=("${c1[@]}" --data-plane shm --shm-staging-mib 1200) ;;
    inline-c1) args=("${c1[@]}") ;;
    cuda-shm-c64) args=("${c64[@]}" --data-plane cuda-shm) ;;
    inline-c64) args=("${c64[@]}") ;;
    *) echo "server_ab.sh: unknown row $1" >&2; exit 2 ;;
  esac
}

labels=(A B C D E F)
{
  for ((k = 0; k < ${#bins[@]}; ++k)); do echo "${labels[$k]} = ${bins[$k]}"; done
  for round in $(seq 1 "$rounds"); do
    for r in "${rows[@]}"; do
      row_args "$r"
      for ((k = 0; k < ${#bins[@]}; ++k)); do
        row "${bins[$k]}" "${labels[$k]}-$r-$round" "${args[@]}"
      done
    done
  done
} | tee "$out/server-ab.txt"
