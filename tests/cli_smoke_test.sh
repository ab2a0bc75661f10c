#!/usr/bin/env bash
# End to end with the real binaries: start mlaverify-server on a loopback
# port, check health and /readyz, run `mlaverify-client demo` (every output
# checked against the client's reference) and a short `load` (zero errors, the
# free-page count back to its start), a short `soak` (the same with random
# lifetimes and calls cut by their deadline), then SIGTERM: the server must drain and
# exit 0.
#   tests/cli_smoke_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/mlaverify-smoke.XXXX)
server_pid=""
trap '[ -n "$server_pid" ] && kill -9 "$server_pid" 2>/dev/null; rm -rf "$work"' EXIT

"$build/server/mlaverify-server" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$work/ports" --backend cpu --layers 4 --heads 8 --page-size 16 --pool-bytes 64MiB \
  --max-message-bytes 1MiB --cpu-threads 1 --drain-grace-s 0 > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do
  [ -s "$work/ports" ] && break
  sleep 0.1
done
read -r grpc_port admin_port < "$work/ports"
client=("$build/client/mlaverify-client" --target "127.0.0.1:$grpc_port")

fail() {
  echo "cli smoke test FAILED: $*" >&2
  exit 1
}
"${client[@]}" health
test "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin_port/readyz")" = 200
# --version: name, version, git revision, build; exit 0.
"$build/client/mlaverify-client" --version > "$work/version.out" || fail "client --version exited non-zero"
grep -qE '^mlaverify-client [0-9]+\.[0-9]+\.[0-9]+ \(git ([0-9a-f]{12}|unknown); .+\)$' "$work/version.out" ||
  fail "client --version printed: $(cat "$work/version.out")"
# Global flags also after the subcommand; switches bare or with a value.
"$build/client/mlaverify-client" health --target "127.0.0.1:$grpc_port" --timeout-ms 5000 ||
  fail "health with --target after the subcommand"
"${client[@]}" info --json=false > "$work/info.txt" || fail "info --json=false"
grep -q "max draft length" "$work/info.txt" || fail "info --json=false did not print text: $(cat "$work/info.txt")"
"${client[@]}" --wait-for-ready true info --json > "$work/info.json" || fail "info --json"
python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/info.json" ||
  fail "info --json did not print JSON: $(cat "$work/info.json")"
"${client[@]}" demo --sequences 2 --prompt-len 100 --steps 2 --drafts 6
"${client[@]}" demo --sequences 1 --prompt-len 0 --steps 2 --drafts 1 --stream
"${client[@]}" load --concurrency 4 --duration-s 3 --warmup-s 1 --json "$work/load.json"
grep -q '"page_leak": false' "$work/load.json" || fail "load reports a page leak: $(cat "$work/load.json")"
# The slowest call the report names is the latency maximum it prints.
python3 - "$work/load.json" <<'PY' || fail "load's slowest_call does not match its max: $(cat "$work/load.json")"
import json, sys
r = json.load(open(sys.argv[1]))
s, l = r["slowest_call"], r["latency_ms"]
assert s["worker"] >= 0 and s["ms"] == l["max"] and 0 <= s["started_s"] <= r["measured_seconds"], (s, l)
PY
# Open loop: 20 calls/s asked and answered (far below what the server does
# closed loop, also under the sanitizers), at most a few late; a sweep over
# concurrency writes one report per value.
"${client[@]}" load --rate 20 --concurrency 4 --duration-s 3 --warmup-s 0.5 --progress false \
  --json "$work/rate.json" > "$work/rate.log" || fail "open-loop load: $(cat "$work/rate.log")"
"${client[@]}" load --sweep 1,2 --duration-s 1 --warmup-s 0.2 --progress false \
  --json "$work/sweep.json" > "$work/sweep.log" || fail "sweep: $(cat "$work/sweep.log")"
python3 - "$work/rate.json" "$work/sweep.json" <<'PY' || fail "rate/sweep reports: $(cat "$work/rate.json" "$work/sweep.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["pass"] and r["options"]["rate"] == 20 and 16 <= r["calls_per_second"] <= 22, r
assert r["late_starts"] <= 5, r
s = json.load(open(sys.argv[2]))
assert s["sweep"] == "concurrency", s
assert [x["options"]["concurrency"] for x in s["runs"]] == [1, 2], s
assert all(x["pass"] and x["verify_calls"] > 0 for x in s["runs"]), s
PY
# A short soak: whole sequence lifetimes, a third of the Verify calls cut
# short by their deadline; every answer checked, no page or sequence left.
"${client[@]}" soak --workers 4 --duration-s 4 --cut-fraction 0.3 --json "$work/soak.json"
python3 - "$work/soak.json" <<'PY' || fail "soak report: $(cat "$work/soak.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["passed"] and not r["unexpected"], r
assert r["cut_calls"] > 0 and r["checked_items"] > 0 and r["commits"] > 0, r
assert r["free_pages_after"] == r["free_pages_before"] and r["live_after"] == 0, r
PY
soak_rc=0
"${client[@]}" soak --workers 0 || soak_rc=$?
[ "$soak_rc" -eq 2 ] || fail "soak --workers 0 exited $soak_rc, not 2 (usage error)"
# Read the whole body first: `curl | grep -q` under pipefail fails at random
# when grep exits on its match while curl is still writing (EPIPE).
metrics=$(curl -sf "http://127.0.0.1:$admin_port/metrics") || fail "GET /metrics"
grep -q 'mlaverify_requests_total{code="OK",rpc="Verify"}' <<< "$metrics" ||
  fail "/metrics has no OK Verify counter"

kill -TERM "$server_pid"
server_rc=0
wait "$server_pid" || server_rc=$?
server_pid=""
[ "$server_rc" -eq 0 ] || fail "the server exited with $server_rc after SIGTERM: $(tail -5 "$work/server.log")"
grep -q "0 live sequences" "$work/server.log" || fail "no clean drain in the server log: $(tail -5 "$work/server.log")"
echo "cli smoke test passed"
