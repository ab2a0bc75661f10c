#!/usr/bin/env bash
# An fp8 pool end to end with the real binaries on the CPU backend: the
# server started with --kv-dtype fp8 reports it (info, metrics), holds at
# least 1.75x the pages of bf16 in the same --pool-bytes, and `demo` passes
# its reference check (rows quantized as the server stores them) over every
# data plane the CPU backend has: inline bytes, system shared memory, and
# VerifyStream.
#   tests/cli_fp8_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/mlaverify-fp8.XXXX)
server_pid=""
trap '[ -n "$server_pid" ] && kill -9 "$server_pid" 2>/dev/null; rm -rf "$work"' EXIT

fail() {
  echo "cli fp8 test FAILED: $*" >&2
  exit 1
}

"$build/server/mlaverify-server" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$work/ports" --backend cpu --layers 4 --heads 8 --page-size 16 --pool-bytes 64MiB \
  --kv-dtype fp8 --allow-client-shm --max-message-bytes 1MiB --cpu-threads 1 --drain-grace-s 0 \
  > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do
  [ -s "$work/ports" ] && break
  sleep 0.1
done
[ -s "$work/ports" ] || fail "the server did not start: $(cat "$work/server.log")"
read -r grpc_port admin_port < "$work/ports"
client=("$build/client/mlaverify-client" --target "127.0.0.1:$grpc_port")

"${client[@]}" info --json - > "$work/info.json" || fail "info"
python3 - "$work/info.json" <<'PY' || fail "info: $(cat "$work/info.json")"
import json, sys
info = json.load(open(sys.argv[1]))
assert info["kv_dtype"] == "fp8", info["kv_dtype"]
assert info["kv_row_bytes"] == 656, info["kv_row_bytes"]
pool, per_page = 64 << 20, 4 * 16
assert info["total_pages"] == pool // (per_page * 656), info["total_pages"]
bf16_pages = pool // (per_page * 1152)
assert info["total_pages"] >= 1.75 * bf16_pages, (info["total_pages"], bf16_pages)
print(f"ok: fp8 pool of {info['total_pages']} pages, bf16 would hold {bf16_pages}")
PY
# Into a file first: grep -q stops reading at the match, and curl's broken
# pipe would fail the pipeline under pipefail.
curl -s "http://127.0.0.1:$admin_port/metrics" > "$work/metrics.txt" || fail "metrics: curl"
grep -q '^mlaverify_kv_row_bytes{dtype="fp8"} 656' "$work/metrics.txt" ||
  fail "metrics: no mlaverify_kv_row_bytes{dtype=\"fp8\"} 656"

"${client[@]}" demo --sequences 2 --prompt-len 100 --steps 2 --drafts 6 ||
  fail "demo, inline bytes"
"${client[@]}" demo --sequences 2 --prompt-len 70 --steps 2 --drafts 5 --data-plane shm ||
  fail "demo, system shared memory"
"${client[@]}" demo --sequences 1 --prompt-len 0 --steps 2 --drafts 3 --stream ||
  fail "demo, VerifyStream"

kill -TERM "$server_pid"
wait "$server_pid" || fail "the server exited non-zero after SIGTERM"
server_pid=""
grep -q "fp8 KV (656 bytes per row)" "$work/server.log" || fail "the start line names no fp8 pool"
echo "cli fp8 test passed"
