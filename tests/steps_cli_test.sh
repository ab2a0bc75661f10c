#!/usr/bin/env bash
# Device-driven steps end to end with the real binaries on the CPU backend
# (host doorbells): `load --steps` against a server with --allow-client-shm
# (steps committed, every layer timed, no error, every page back); GPU
# doorbells refused by the CPU server with exit 2; and a scheduler killed
# with SIGKILL mid-step: its step aborts at the layer timeout, its sequences
# expire, every page is back, no step is left open, and the next steps run.
#   tests/steps_cli_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/mlaverify-steps.XXXX)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "steps CLI test FAILED: $*" >&2
  exit 1
}

"$build/server/mlaverify-server" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$work/ports" --backend cpu --layers 4 --heads 8 --page-size 16 --pool-bytes 64MiB \
  --cpu-threads 1 --drain-grace-s 0 --allow-client-shm true --step-layer-timeout-ms 500 \
  --idle-timeout-s 1 > "$work/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  [ -s "$work/ports" ] && break
  sleep 0.1
done
[ -s "$work/ports" ] || fail "the server did not start: $(cat "$work/server.log")"
read -r port admin < "$work/ports"
client=("$build/client/mlaverify-client" --target "127.0.0.1:$port")
metric() {  # metric NAME_AND_LABELS: its value in /metrics (0 when absent)
  curl -s "http://127.0.0.1:$admin/metrics" | awk -v m="$1" '$1 == m {print $2; found=1}
    END {if (!found) print 0}'
}

"${client[@]}" load --steps --doorbell host --concurrency 2 --items 2 --duration-s 2 \
  --warmup-s 0.5 --prompt-len 48 --drafts 4 --json "$work/steps.json" > "$work/steps.log" 2>&1 ||
  fail "load --steps: $(cat "$work/steps.log")"
python3 - "$work/steps.json" <<'PY' || fail "load --steps report: $(cat "$work/steps.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["pass"] and r["mode"] == "steps" and r["total_errors"] == 0, r
assert r["steps"] > 0 and r["items"] == 2 * r["steps"], r
assert r["layer_us"]["count"] == r["steps"] * r["num_layers"] * r["ranks"], r["layer_us"]
assert r["step_ms"]["p50"] >= r["layers_ms"]["p50"] > 0, r
assert r["free_pages_after"] == r["free_pages_before"] and not r["page_leak"], r
assert r["server"]["backend"] == "cpu" and r["options"]["doorbell"] == "host", r
PY
[ "$(metric 'mlaverify_device_steps_ended_total{outcome="committed",reason="none"}')" != 0 ] ||
  fail "no committed step in /metrics"

rc=0
"${client[@]}" load --steps --doorbell gpu --duration-s 1 > "$work/gpu.log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || fail "GPU doorbells on the CPU backend exited $rc: $(cat "$work/gpu.log")"
grep -q "takes no gpu doorbells" "$work/gpu.log" || fail "no reason given: $(cat "$work/gpu.log")"

# The victim spends 100 ms of its own work before every ring, so it is
# mid-step when it dies.
"${client[@]}" load --steps --doorbell host --client-work-us 100000 --duration-s 60 \
  --warmup-s 0 --prompt-len 48 --drafts 4 --progress false > "$work/victim.log" 2>&1 &
victim=$!
pids+=("$victim")
sleep 2
kill -KILL "$victim"
wait "$victim" 2>/dev/null || true
rm -f /dev/shm/mlaverify-"$victim"-*
# The layer timeout (0.5 s), then the idle expiry (1 s) of its sequences.
for _ in $(seq 1 50); do
  [ "$(metric mlaverify_sequences_live)" = 0 ] && break
  sleep 0.2
done
aborted=$(metric 'mlaverify_device_steps_ended_total{outcome="aborted",reason="layer_timeout"}')
[ "$aborted" != 0 ] || fail "the killed scheduler's step was not aborted by the layer timeout"
[ "$(metric mlaverify_device_steps_open)" = 0 ] || fail "a step is still open"
[ "$(metric mlaverify_sequences_live)" = 0 ] || fail "the killed scheduler's sequences stayed"
[ "$(metric mlaverify_kv_pages_free)" = "$(metric mlaverify_kv_pages_capacity)" ] ||
  fail "pages not back: $(metric mlaverify_kv_pages_free) of $(metric mlaverify_kv_pages_capacity)"
grep -q "aborted (layer_timeout)" "$work/server.log" || fail "no abort in the server's log"

"${client[@]}" load --steps --doorbell host --duration-s 1 --warmup-s 0.2 --prompt-len 48 \
  --drafts 4 > "$work/after.log" 2>&1 || fail "steps after the kill: $(cat "$work/after.log")"
echo "steps CLI test passed"
