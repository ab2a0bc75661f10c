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
# A subcommand's help says where the connection's options are listed.
for sub in info health demo load soak; do
  "$build/client/mlaverify-client" "$sub" --help | grep -q "mlaverify-client --help lists them" ||
    fail "$sub --help does not point to the global options"
done
# Global flags also after the subcommand; switches bare or with a value.
"$build/client/mlaverify-client" health --target "127.0.0.1:$grpc_port" --timeout-ms 5000 ||
  fail "health with --target after the subcommand"
"${client[@]}" info > "$work/info.txt" || fail "info"
grep -q "max draft length" "$work/info.txt" || fail "info did not print text: $(cat "$work/info.txt")"
"${client[@]}" --wait-for-ready true info --json - > "$work/info.json" || fail "info --json -"
python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/info.json" ||
  fail "info --json - did not print JSON: $(cat "$work/info.json")"
"${client[@]}" info --json "$work/info-file.json" > /dev/null || fail "info --json FILE"
cmp -s <(python3 -c 'import json, sys; print(sorted(json.load(open(sys.argv[1]))))' "$work/info.json") \
  <(python3 -c 'import json, sys; print(sorted(json.load(open(sys.argv[1]))))' "$work/info-file.json") ||
  fail "info --json FILE and --json - differ"
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
# Decode steps as a scheduler waits for them: every layer's call and the
# commits; a step takes at least its layers' calls, and adds at least one
# token per item.
python3 - "$work/load.json" <<'PY' || fail "load's decode steps are implausible: $(cat "$work/load.json")"
import json, sys
r = json.load(open(sys.argv[1]))
d, l = r["decode_steps"], r["latency_ms"]
assert d["layers"] == r["geometry"]["num_layers"] == 4, d
assert d["measured"] > 0 and d["tokens"] >= d["measured"] * r["options"]["items"], d
assert d["latency_ms"]["p50"] >= 0.5 * d["layers"] * l["p50"], (d, l)
assert d["tokens_per_second"] > 0, d
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
# Every results file says where it came from: when, which client and
# command line, each server's version and instance, and --metadata.
python3 - "$work/rate.json" <<'PY' || fail "provenance: $(cat "$work/rate.json")"
import json, sys
r = json.load(open(sys.argv[1]))
p = r["provenance"]
assert p["written_utc"].endswith("Z") and p["client"].startswith("mlaverify-client"), p
assert "load --rate 20" in p["command_line"], p
(server,) = p["servers"]
assert server["backend"] == "cpu" and server["instance_id"] and server["version"], server
assert r["metadata"] == {}, r["metadata"]
PY
"${client[@]}" load --concurrency 1 --duration-s 0.5 --warmup-s 0.1 --progress false \
  --metadata card=none --metadata "note=two words" --json "$work/meta.json" > "$work/meta.log" ||
  fail "load with metadata: $(cat "$work/meta.log")"
python3 -c 'import json,sys; m = json.load(open(sys.argv[1]))["metadata"]; assert m == {"card": "none", "note": "two words"}, m' \
  "$work/meta.json" || fail "metadata: $(cat "$work/meta.json")"
if "${client[@]}" load --metadata novalue --duration-s 0.5 > "$work/badmeta.log" 2>&1; then
  fail "--metadata without = accepted"
fi

# Poisson arrivals keep the asked rate on average; prompt and draft ranges
# draw every size between their ends (the mean tree size lies inside); burst
# arrivals pass at a rate the server answers; a range upside down is a usage
# error, and so is --arrivals without --rate.
"${client[@]}" load --rate 40 --arrivals poisson --concurrency 4 --prompt-len 16:64 --drafts 2:6 \
  --duration-s 3 --warmup-s 0.5 --progress false --json "$work/poisson.json" > "$work/poisson.log" ||
  fail "poisson load with ranges: $(cat "$work/poisson.log")"
grep -q "N=2..6, prompt 16..64" "$work/poisson.log" || fail "no ranges in the header: $(cat "$work/poisson.log")"
"${client[@]}" load --rate 40 --arrivals burst --burst-size 4 --concurrency 4 --duration-s 2 \
  --warmup-s 0.3 --progress false --json "$work/burst.json" > "$work/burst.log" ||
  fail "burst load: $(cat "$work/burst.log")"
python3 - "$work/poisson.json" "$work/burst.json" <<'PY' || fail "arrival reports: $(cat "$work/poisson.json")"
import json, sys
r = json.load(open(sys.argv[1]))
o = r["options"]
assert o["arrivals"] == "poisson" and o["prompt_len"] == 16 and o["prompt_len_max"] == 64, o
assert o["drafts"] == 2 and o["drafts_max"] == 6 and r["geometry"]["num_drafts_max"] == 6, r
assert r["pass"] and 28 <= r["calls_per_second"] <= 52, r
# 120 calls of 2..6 drafts: a mean outside (2.5, 5.5) is not uniform draws.
assert 2.5 < r["mean_drafts_per_item"] < 5.5, r
assert r["draft_tokens"] == round(r["mean_drafts_per_item"] * r["verify_items"]), r
b = json.load(open(sys.argv[2]))
assert b["options"]["arrivals"] == "burst" and b["options"]["burst_size"] == 4, b["options"]
assert b["pass"] and 28 <= b["calls_per_second"] <= 52, b
PY
for bad in "--prompt-len 64:16" "--drafts 6:2" "--arrivals poisson" "--arrivals gamma --rate 5"; do
  bad_rc=0
  # shellcheck disable=SC2086  # the flags are several words
  "${client[@]}" load $bad --duration-s 0.5 --progress false > "$work/badrange.log" 2>&1 || bad_rc=$?
  [ "$bad_rc" -eq 2 ] || fail "load $bad exited $bad_rc, not 2: $(cat "$work/badrange.log")"
done

# An open loop the server cannot keep up with fails and says so (its
# figures describe a saturated server, not the rate asked for).
if "${client[@]}" load --rate 100000 --concurrency 2 --duration-s 1 --warmup-s 0.2 \
  --progress false --json "$work/missed.json" > "$work/missed.log" 2>&1; then
  fail "an open loop at 100000 calls/s passed: $(cat "$work/missed.log")"
fi
grep -q "FAIL (open loop answered" "$work/missed.log" || fail "no rate verdict: $(cat "$work/missed.log")"
python3 - "$work/missed.json" <<'PY' || fail "missed-rate report: $(cat "$work/missed.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert not r["pass"] and r["rate_missed"] and r["total_errors"] == 0, r
PY
# The pool and the report's new parts: 4 connections, each carrying calls;
# p95 and a chosen percentile; a histogram holding every call; a per-second
# series; the CSV row (to stdout with '-', the text report going to stderr)
# agreeing with the JSON.
"${client[@]}" --connections 4 load --concurrency 8 --duration-s 2 --warmup-s 0.3 --progress false \
  --percentile 99.5 --json "$work/pool.json" --csv - > "$work/pool.csv" 2> "$work/pool.log" ||
  fail "load over 4 connections: $(cat "$work/pool.log")"
python3 - "$work/pool.json" "$work/pool.csv" <<'PY' || fail "pool report: $(cat "$work/pool.json" "$work/pool.csv")"
import csv, json, sys
r = json.load(open(sys.argv[1]))
assert r["pass"] and r["connections"] == 4, r["connections"]
assert len(r["connection_calls"]) == 4 and all(c["calls"] > 0 and c["failed"] == 0 for c in r["connection_calls"]), r["connection_calls"]
l = r["latency_ms"]
assert l["p50"] <= l["p90"] <= l["p95"] <= l["p99"] <= l["p99_5"] <= l["max"], l
h = r["latency_histogram_ms"]
assert sum(b["count"] for b in h) == l["count"] == r["verify_calls"] > 0, (h, l)
assert all(a["le"] < b["le"] for a, b in zip(h, h[1:])) and h[-1]["le"] >= l["max"] and h[-1]["le"] < 1.2 * l["max"], h
s = r["series"]
assert [x["second"] for x in s] == list(range(len(s))) and 2 <= len(s) <= 4, s
assert sum(x["calls"] for x in s) == r["verify_calls"] and all(x["errors"] == 0 for x in s), s
rows = list(csv.DictReader(open(sys.argv[2])))
assert len(rows) == 1 and int(rows[0]["connections"]) == 4 and rows[0]["pass"] == "1", rows
assert abs(float(rows[0]["p99_5_ms"]) - l["p99_5"]) < 1e-3 and abs(float(rows[0]["calls_per_second"]) - r["calls_per_second"]) < 1e-2, rows
PY
# Stability windows: a loose 50% is reached within the windows allowed and
# ends the run (exit 0, at least 3 windows, the report covering the last 3);
# an impossible 1e-4% fails as unstable after exactly --max-windows (exit 1).
"${client[@]}" load --concurrency 4 --warmup-s 0.3 --stability-percent 50 --window-s 0.5 \
  --max-windows 20 --progress false --json "$work/stable.json" > "$work/stable.log" ||
  fail "stable load: $(cat "$work/stable.log")"
unstable_rc=0
"${client[@]}" load --concurrency 4 --warmup-s 0.3 --stability-percent 0.0001 --window-s 0.3 \
  --max-windows 3 --progress false --json "$work/unstable.json" > "$work/unstable.log" || unstable_rc=$?
[ "$unstable_rc" -eq 1 ] || fail "an unstable load exited $unstable_rc, not 1: $(cat "$work/unstable.log")"
grep -q "FAIL (not stable)" "$work/unstable.log" || fail "no 'not stable' verdict: $(cat "$work/unstable.log")"
python3 - "$work/stable.json" "$work/unstable.json" <<'PY' || fail "stability reports: $(cat "$work/stable.json" "$work/unstable.json")"
import json, sys
r = json.load(open(sys.argv[1]))
st = r["stability"]
assert r["pass"] and st["reached"] and 3 <= st["windows"] <= 20, st
last = st["calls_per_second"][-3:]
m = sum(last) / 3
assert all(abs(x - m) <= 0.5 * m for x in last), st
assert abs(r["measured_seconds"] - 1.5) < 1e-6, r["measured_seconds"]
# The slowest call named is the reported window's: its maximum, started inside it.
s, l = r["slowest_call"], r["latency_ms"]
first = (st["windows"] - 3) * r["options"]["window_s"]
assert s["ms"] == l["max"] and first <= s["started_s"] < first + 1.5, (s, l, first)
u = json.load(open(sys.argv[2]))
assert not u["pass"] and not u["stability"]["reached"] and u["stability"]["windows"] == 3, u["stability"]
PY
# The capacity check: 64 sequences of 500 tokens cannot fit the 64 MiB pool;
# the run fails at once, before any prompt goes up, naming the pages.
cap_rc=0
start_s=$(date +%s)
"${client[@]}" load --concurrency 64 --prompt-len 500 --duration-s 5 --progress false \
  > "$work/cap.log" 2>&1 || cap_rc=$?
[ "$cap_rc" -eq 1 ] || fail "an oversized load exited $cap_rc, not 1: $(cat "$work/cap.log")"
grep -q "the pool cannot hold the run's first sequences: 64 workers x 1 items = 64 sequences" "$work/cap.log" ||
  fail "no capacity message: $(cat "$work/cap.log")"
[ $(($(date +%s) - start_s)) -le 5 ] || fail "the capacity check took over 5 s"
grep -q "ramp-up" "$work/cap.log" && fail "the oversized load started its ramp-up: $(cat "$work/cap.log")"
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
