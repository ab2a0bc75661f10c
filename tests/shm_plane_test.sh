#!/usr/bin/env bash
# The system shared-memory data plane end to end with the real binaries: a
# CPU server with --allow-client-shm, the checked demo over shm (unary and
# stream), a load with several items per call over shm with the transport
# floor, a load interrupted by SIGINT (it must still report, unregister its
# region and leave nothing in /dev/shm), and a server without the flag, which
# must refuse the demo's registration with FAILED_PRECONDITION.
#   tests/shm_plane_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/mlaverify-shm.XXXX)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# left_in_dev_shm PID: whether a process left a shared-memory object behind.
left_in_dev_shm() { compgen -G "/dev/shm/mlaverify-$1-*" > /dev/null; }
fail() {
  echo "shm plane test FAILED: $*" >&2
  exit 1
}

# start_server NAME FLAGS...: sets $port.
start_server() {
  local name=$1
  shift
  "$build/server/mlaverify-server" --listen 127.0.0.1:0 --admin-port -1 \
    --port-file "$work/$name.ports" --backend cpu --layers 4 --heads 8 --page-size 16 \
    --pool-bytes 64MiB --cpu-threads 1 --drain-grace-s 0 "$@" > "$work/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do
    [ -s "$work/$name.ports" ] && break
    sleep 0.1
  done
  [ -s "$work/$name.ports" ] || fail "server $name did not start: $(cat "$work/$name.log")"
  read -r port _ < "$work/$name.ports"
}

start_server shm --allow-client-shm true
client=("$build/client/mlaverify-client" --target "127.0.0.1:$port")
"${client[@]}" demo --sequences 2 --prompt-len 100 --steps 2 --drafts 6 --data-plane shm \
  > "$work/demo.log" || fail "demo over shm: $(cat "$work/demo.log")"
grep -q "shm data plane" "$work/demo.log" || fail "the demo did not use shm"
"${client[@]}" demo --sequences 2 --prompt-len 40 --steps 1 --drafts 4 --data-plane shm --stream \
  > "$work/demo-stream.log" || fail "streamed demo over shm: $(cat "$work/demo-stream.log")"

"${client[@]}" load --concurrency 2 --items 3 --stream --data-plane shm --floor --duration-s 2 \
  --warmup-s 0.5 --prompt-len 64 --drafts 4 --json "$work/load.json" > "$work/load.log" 2>&1 ||
  fail "load over shm: $(cat "$work/load.log")"
python3 - "$work/load.json" <<'PY' || fail "load report: $(cat "$work/load.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["pass"] and r["total_errors"] == 0 and r["errors_by_rpc"] == {}, r
assert r["options"]["data_plane"] == "shm" and r["options"]["items"] == 3, r["options"]
assert r["verify_items"] == 3 * r["verify_calls"] > 0, r
assert r["free_pages_after"] == r["free_pages_before"], r
assert r["server_split_us"]["calls"] >= r["verify_calls"] and r["server_split_us"]["server"] > 0, r
f = r["floor"]
assert f["calls"] > 0 and f["errors"] == 0 and f["request_bytes"] < 4096, f  # references only
assert r["append"]["bytes"] > 0, r["append"]
PY
# Inline, the floor echoes the whole call: --items 3 requests carry three
# items' q and draft_kv (N=4, 8 heads: 3 x 4 x 576 x 2 x 9 bytes) and three
# results' out and lse.
"${client[@]}" load --concurrency 1 --items 3 --floor --duration-s 1 --warmup-s 0.2 \
  --prompt-len 64 --drafts 4 --json "$work/load-inline.json" > "$work/load-inline.log" 2>&1 ||
  fail "inline load: $(cat "$work/load-inline.log")"
python3 - "$work/load-inline.json" <<'PY' || fail "inline floor: $(cat "$work/load-inline.json")"
import json, sys
r = json.load(open(sys.argv[1]))
f = r["floor"]
assert f["request_bytes"] >= 3 * 4 * 576 * 2 * 9, f
assert f["reply_bytes"] >= 3 * (4 * 8 * 512 * 2 + 4 * 8 * 4), f
PY

# SIGINT in the middle of a long load: it ends as if its time were up.
"${client[@]}" load --concurrency 2 --data-plane shm --duration-s 60 --warmup-s 0 \
  --prompt-len 32 --drafts 4 > "$work/interrupted.log" 2>&1 &
load_pid=$!
pids+=("$load_pid")
sleep 2
kill -INT "$load_pid"
load_rc=0
wait "$load_pid" || load_rc=$?
[ "$load_rc" -eq 0 ] || fail "interrupted load exited $load_rc: $(cat "$work/interrupted.log")"
grep -q "^result:       PASS" "$work/interrupted.log" || fail "no report after SIGINT"
left_in_dev_shm "$load_pid" && fail "the load left its object in /dev/shm"
grep -q "region 'mlaverify-load-$load_pid' unregistered" "$work/shm.log" ||
  fail "the load did not unregister its region: $(grep -i shared "$work/shm.log")"

# Without --allow-client-shm the registration is refused, precisely.
start_server plain
"$build/client/mlaverify-client" --target "127.0.0.1:$port" demo --sequences 1 --prompt-len 10 \
  --steps 1 --drafts 2 --data-plane shm > "$work/refused.log" 2>&1 &
demo_pid=$!
demo_rc=0
wait "$demo_pid" || demo_rc=$?
[ "$demo_rc" -eq 1 ] || fail "demo over shm on a plain server exited $demo_rc"
grep -q "FAILED_PRECONDITION.*--allow-client-shm" "$work/refused.log" ||
  fail "no FAILED_PRECONDITION naming --allow-client-shm: $(cat "$work/refused.log")"
left_in_dev_shm "$demo_pid" && fail "the refused demo left its object in /dev/shm"
echo "shm plane test passed"
