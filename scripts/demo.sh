#!/usr/bin/env bash
# The README's demo command: installs what is missing, builds, starts
# mlaverify-server (backend auto: the GPU when one is present and the CUDA
# backend is built, else the CPU backend), runs `mlaverify-client demo`
# against it (a speculative-decoding loop whose every output is checked
# against the client's own reference computation), shows a few metrics, and
# stops the server with SIGTERM.
#   scripts/demo.sh [extra mlaverify-client demo flags]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/server_wait.sh
. scripts/server_wait.sh
scripts/install_deps.sh
scripts/build.sh

work=$(mktemp -d /tmp/mlaverify-demo.XXXX)
server_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    wait "$server_pid" || true
  fi
}
trap cleanup EXIT

# Kimi K2 geometry per GPU of 8 (61 layers, 8 heads of 64), page size 64.
build/server/mlaverify-server --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$work/ports" --backend auto --layers 61 --heads 8 --page-size 64 \
  --pool-bytes 1GiB --max-message-bytes 8MiB --idle-timeout-s 300 > "$work/server.log" 2>&1 &
server_pid=$!
wait_for_port_file "$work/ports" "$server_pid" "$work/server.log" 10
read -r grpc_port admin_port < "$work/ports"
target="127.0.0.1:$grpc_port"
echo "== server (log: $work/server.log)"
cat "$work/server.log"
build/client/mlaverify-client --target "$target" health

echo "== demo"
status=0
build/client/mlaverify-client --target "$target" demo --sequences 2 --prompt-len 300 --steps 4 \
  --drafts 8 "$@" || status=$?

echo "== a few metrics from http://127.0.0.1:$admin_port/metrics"
curl -sf "http://127.0.0.1:$admin_port/metrics" |
  grep -E '^mlaverify_(requests_total\{code="OK",rpc="Verify"\}|kv_pages_(used|free)|sequences_live|tokens_committed_total)' || true

echo "== stopping the server (SIGTERM: drain)"
kill -TERM "$server_pid"
wait "$server_pid" || status=$?
server_pid=""
tail -3 "$work/server.log"
exit $status
