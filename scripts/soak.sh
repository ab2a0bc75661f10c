#!/usr/bin/env bash
# Soak: starts mlaverify-server (backend auto, the demo's Kimi K2 geometry
# unless overridden), runs a warm-up `mlaverify-client soak`, records the
# server's resident memory, threads and open files, runs the measured soak
# (whole sequence lifetimes, every answer checked against the client's CPU
# reference, a share of Verify calls cut short by their deadline), records
# them again and stops the server with SIGTERM. Fails when the soak reports
# an error, a wrong answer or a leaked page, when resident memory or threads
# grew more than 10 % (gRPC's executor may add a thread under load; a leak
# grows without bound), when open files grew, or when the drain was unclean.
#   scripts/soak.sh [--duration-s 600] [--warmup-s 60] [--workers 64]
#                   [--out DIR] [--server-flags "..."] [--soak-flags "..."]
#                   [--bin-dir DIR]
# Writes DIR/soak.json (the client's report plus the process figures),
# DIR/server.log and DIR/metrics.txt. Builds first (scripts/build.sh) unless
# --bin-dir names a folder that holds mlaverify-server and mlaverify-client
# already built (a bundle of scripts/bundle.sh on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/server_wait.sh
. scripts/server_wait.sh

duration_s=600
warmup_s=60
workers=64
out=""
server_flags="--layers 61 --heads 8 --page-size 64 --pool-bytes 1GiB --max-message-bytes 8MiB"
soak_flags=""
bin_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration-s) duration_s=$2; shift 2 ;;
    --warmup-s) warmup_s=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --server-flags) server_flags=$2; shift 2 ;;
    --soak-flags) soak_flags=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    *) echo "soak.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || out=$(mktemp -d /tmp/mlaverify-soak.XXXX)
mkdir -p "$out"
if [ -n "$bin_dir" ]; then
  server_bin=$bin_dir/mlaverify-server
  client_bin=$bin_dir/mlaverify-client
else
  scripts/build.sh
  server_bin=build/server/mlaverify-server
  client_bin=build/client/mlaverify-client
fi

server_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid"
  fi
}
trap cleanup EXIT

# shellcheck disable=SC2086  # server_flags is a list of flags
"$server_bin" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$out/ports" --backend auto --idle-timeout-s 300 $server_flags \
  > "$out/server.log" 2>&1 &
server_pid=$!
# The port file is written once SERVING (on a GPU: after the pools and graphs).
wait_for_port_file "$out/ports" "$server_pid" "$out/server.log" 120
read -r grpc_port admin_port < "$out/ports"
target="127.0.0.1:$grpc_port"
"$client_bin" --target "$target" health

# rss_kib threads open_files of the server.
process_figures() {
  local rss threads files
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status")
  threads=$(awk '/^Threads:/ {print $2}' "/proc/$server_pid/status")
  files=$(find "/proc/$server_pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
  echo "$rss $threads $files"
}

run_soak() {  # seconds json
  # shellcheck disable=SC2086  # soak_flags is a list of flags
  "$client_bin" --target "$target" soak --workers "$workers" \
    --duration-s "$1" --json "$2" $soak_flags
}

echo "== warm-up soak, $warmup_s s, $workers workers"
run_soak "$warmup_s" "$out/warmup.json"
read -r rss0 threads0 files0 < <(process_figures)
echo "server after warm-up: rss ${rss0} KiB, ${threads0} threads, ${files0} open files"

echo "== measured soak, $duration_s s, $workers workers"
status=0
run_soak "$duration_s" "$out/measured.json" || status=$?
read -r rss1 threads1 files1 < <(process_figures)
echo "server at the end:    rss ${rss1} KiB, ${threads1} threads, ${files1} open files"
curl -sf "http://127.0.0.1:$admin_port/metrics" > "$out/metrics.txt" || true

kill -TERM "$server_pid"
drain=0
wait "$server_pid" || drain=$?
server_pid=""
tail -2 "$out/server.log"

growth_ok=$(awk -v a="$rss0" -v b="$rss1" 'BEGIN {print (b <= a * 1.10) ? 1 : 0}')
threads_ok=$(awk -v a="$threads0" -v b="$threads1" 'BEGIN {print (b <= a * 1.10) ? 1 : 0}')
verdict=PASS
[ "$status" -eq 0 ] || { echo "soak: the measured run failed (exit $status)"; verdict=FAIL; }
[ "$growth_ok" -eq 1 ] || { echo "soak: resident memory grew more than 10 %"; verdict=FAIL; }
[ "$threads_ok" -eq 1 ] || { echo "soak: threads grew more than 10 %"; verdict=FAIL; }
[ "$files1" -le "$files0" ] || { echo "soak: open files grew"; verdict=FAIL; }
[ "$drain" -eq 0 ] || { echo "soak: the server exited $drain after SIGTERM"; verdict=FAIL; }

python3 - "$out" "$rss0" "$rss1" "$threads0" "$threads1" "$files0" "$files1" "$drain" \
  "$verdict" "$server_flags" "$soak_flags" "$workers" <<'EOF'
import json, os, sys
def load(path):
    return json.load(open(path)) if os.path.exists(path) else None
out, rss0, rss1, t0, t1, f0, f1, drain, verdict, server_flags, soak_flags, workers = sys.argv[1:]
result = {
    "verdict": verdict,
    "server_flags": server_flags,
    "soak_flags": soak_flags,
    "workers": int(workers),
    "warmup": load(f"{out}/warmup.json"),
    "measured": load(f"{out}/measured.json"),
    "server_after_warmup": {"rss_kib": int(rss0), "threads": int(t0), "open_files": int(f0)},
    "server_at_end": {"rss_kib": int(rss1), "threads": int(t1), "open_files": int(f1)},
    "rss_growth": int(rss1) / int(rss0) - 1,
    "exit_after_sigterm": int(drain),
}
json.dump(result, open(f"{out}/soak.json", "w"), indent=2)
EOF
echo "soak: $verdict (report: $out/soak.json)"
[ "$verdict" = PASS ]
