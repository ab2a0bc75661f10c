#!/usr/bin/env bash
# Three servers on loopback behind one client (`--target a,b,c`): `load`
# spreads sequences over all three with zero errors and every page back on
# each; then one replica is killed mid-run: the load finishes on the other
# two, reports the lost replica (its calls failed with UNAVAILABLE naming
# it) and exits 3; last, a load against one server killed mid-run fails
# and its report quotes a failed call in full (`first_error`); a load
# against one server restarted mid-run goes on once it is back (workers
# back off on UNAVAILABLE instead of giving up).
#   tests/replicas_test.sh BUILD_DIR
set -uo pipefail
build=$1
server=$build/server/mlaverify-server
client=$build/client/mlaverify-client
work=$(mktemp -d /tmp/mlaverify-replicas.XXXX)
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
check() {  # what, command...
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; failures=$((failures + 1)); fi
}

targets=()
for r in 0 1 2; do
  "$server" --backend cpu --layers 4 --heads 8 --page-size 16 --pool-bytes 32MiB --cpu-threads 1 \
    --listen 127.0.0.1:0 --admin-port -1 --port-file "$work/ports$r" --drain-grace-s 0 \
    > "$work/server$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1 2; do
  for _ in $(seq 1 100); do [ -s "$work/ports$r" ] && break; sleep 0.1; done
  read -r port _ < "$work/ports$r"
  targets+=("127.0.0.1:$port")
done
list=$(IFS=,; echo "${targets[*]}")
load=("$client" --target "$list" load --concurrency 32 --warmup-s 0.5 --prompt-len 32 --drafts 4)

echo "== load over three replicas"
"${load[@]}" --duration-s 4 --json "$work/spread.json" > "$work/spread.log" 2>&1
rc=$?
grep -E "^(replica|errors|first error|pages|result)" "$work/spread.log"
check "load over three replicas exits 0" [ "$rc" -eq 0 ]
check "every replica got sequences and gave every page back" python3 - "$work/spread.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
reps = r["replicas"]
ok = len(reps) == 3 and r["total_errors"] == 0 and r["pass"]
ok = ok and all(x["sequences_created"] > 0 and not x["lost"] and not x["page_leak"]
                and x["free_pages_after"] == x["free_pages_before"] for x in reps)
sys.exit(0 if ok else 1)
PY

echo "== replica 1 killed 2 s into a 6-s load"
"${load[@]}" --duration-s 6 --json "$work/loss.json" > "$work/loss.log" 2>&1 &
load_pid=$!
sleep 2.5
kill -9 "${pids[1]}"
wait "$load_pid"
rc=$?
grep -E "^(replica|errors|first error|pages|result)" "$work/loss.log"
check "the load finishes and exits 3 (replica lost)" [ "$rc" -eq 3 ]
check "replica 1 is reported lost with UNAVAILABLE naming it; the others lost nothing" \
  python3 - "$work/loss.json" "${targets[1]}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
lost = r["replicas"][1]
ok = lost["lost"] and lost["errors_while_down"] > 0
ok = ok and "UNAVAILABLE" in lost["first_error"] and f"replica 1 ({sys.argv[2]})" in lost["first_error"]
ok = ok and r["total_errors"] == 0 and r["survived_replica_loss"]
for x in (r["replicas"][0], r["replicas"][2]):
    ok = ok and not x["lost"] and not x["page_leak"] and x["free_pages_after"] == x["free_pages_before"]
sys.exit(0 if ok else 1)
PY

echo "== one target, killed 1.5 s into a 4-s load: the report quotes a failure in full"
"$client" --target "${targets[2]}" load --concurrency 8 --warmup-s 0.3 --prompt-len 32 --drafts 4 \
  --duration-s 4 --progress false --json "$work/single.json" > "$work/single.log" 2>&1 &
load_pid=$!
sleep 1.5
kill -9 "${pids[2]}"
wait "$load_pid"
rc=$?
grep -E "^(errors|first error)" "$work/single.log"
check "the load fails" [ "$rc" -ne 0 ]
check "first_error quotes an UNAVAILABLE call by its RPC" python3 - "$work/single.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
first = r["first_error"]
rpcs = ("CreateSequence", "AppendKv", "Verify", "VerifyStream", "Commit", "ReleaseSequence")
ok = r["total_errors"] > 0 and "UNAVAILABLE" in first and first.split(":")[0] in rpcs
sys.exit(0 if ok else 1)
PY

echo "== one target down from 1.5 s to 4.5 s of a 12-s load: the workers back off and go on after it"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
restart=("$server" --backend cpu --layers 4 --heads 8 --page-size 16 --pool-bytes 32MiB
         --cpu-threads 1 --listen "127.0.0.1:$port" --admin-port -1 --drain-grace-s 0)
"${restart[@]}" > "$work/restart0.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do "$client" --target "127.0.0.1:$port" health > /dev/null 2>&1 && break; sleep 0.1; done
"$client" --target "127.0.0.1:$port" load --concurrency 4 --warmup-s 0.3 --prompt-len 32 --drafts 4 \
  --duration-s 12 --progress false --json "$work/restart.json" > "$work/restart.log" 2>&1 &
load_pid=$!
sleep 1.5
kill -9 "${pids[-1]}"
sleep 3
"${restart[@]}" > "$work/restart1.log" 2>&1 &
pids+=($!)
wait "$load_pid"
grep -E "^(errors|first error)" "$work/restart.log"
check "calls go on after the restart, to the load's last second" python3 - "$work/restart.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
# Calls after the restart (from second 6 on), in whichever seconds: a
# connection that gRPC is still reconnecting holds the calls routed to it
# for a few seconds, so not every second has some; a worker that gave up
# (the old behaviour) makes none at all.
late = sum(s["calls"] for s in r["series"] if s["second"] >= 6)
ok = r["total_errors"] > 0 and late > 0 and r["series"][-1]["calls"] > 0
print("     calls per second:", [s["calls"] for s in r["series"]], "errors", r["total_errors"])
sys.exit(0 if ok else 1)
PY

if [ "$failures" -ne 0 ]; then
  for r in 0 1 2; do echo "-- server $r log (last lines)"; tail -n 8 "$work/server$r.log"; done
  echo "replicas test FAILED ($failures)"
  exit 1
fi
echo "replicas test passed"
