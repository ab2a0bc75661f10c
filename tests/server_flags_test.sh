#!/usr/bin/env bash
# Bad flags and addresses: each is a clear message and exit status 2, never a
# crash; a port another server holds is refused, never shared (no
# SO_REUSEPORT). --version; boolean switches bare and with a value; the
# --config file read as TOML (each misparse one short error line, a good file
# applied under the command line); --log-format json lines.
#   tests/server_flags_test.sh BUILD_DIR
set -uo pipefail
server=$1/server/mlaverify-server
client=$1/client/mlaverify-client
work=$(mktemp -d /tmp/mlaverify-flags.XXXX)
holder=""
trap '[ -n "$holder" ] && kill -9 "$holder" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
base=(--backend cpu --layers 2 --pool-bytes 16MiB --admin-port -1)

# expect_refused "what" "message part" FLAGS...
expect_refused() {
  local what=$1 want=$2
  shift 2
  local rc=0
  timeout 30 "$server" "${base[@]}" "$@" > "$work/out.log" 2>&1 || rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q -- "$want" "$work/out.log"; then
    echo "FAIL: $what: exit $rc (want 2), output: $(tail -3 "$work/out.log")"
    failures=$((failures + 1))
  else
    echo "ok: $what: $(grep -m1 -- "$want" "$work/out.log")"
  fi
}

expect_refused "--listen without a port" "need host:port" --listen garbage
expect_refused "--listen port out of range" "need host:port" --listen 127.0.0.1:99999
expect_refused "--listen on an address not on this host" "cannot listen" --listen 203.0.113.7:50051
expect_refused "--max-message-bytes of 3 GiB" "max-message-bytes" --max-message-bytes 3GiB
expect_refused "--log-level verbose" "log-level" --log-level verbose
# Engine settings are named by their flags, not by the engine's fields.
expect_refused "--copy-threads 0" "--copy-threads 0: need 1..64" --copy-threads 0
expect_refused "heads that do not split over the devices" "--heads 7 does not split" \
  --heads 7 --devices 0,0
expect_refused "--page-size 48" "--page-size 48: need a power of two" --page-size 48
expect_refused "--draft-buckets 4,2" "--draft-buckets \[4,2\]: need strictly increasing" \
  --draft-buckets 4,2
expect_refused "a switch with a value that is no boolean" "cuda-graphs" --cuda-graphs maybe
expect_refused "--stream-max-in-flight 0" "stream-max-in-flight" --stream-max-in-flight 0
expect_refused "an unknown flag" "workers" --workers 8
expect_refused "a misspelt flag names the one meant" "did you mean --pool-bytes?" --pool-byts 1GiB

# Usage errors read like a command-line tool's: every line "mlaverify-server:
# ...", no log timestamp or level, for CLI11's parse errors and for the
# server's own checks alike.
for bad in "--bogus" "--layers 0" "--heads 7 --devices 0,0 --parallel-mode tp"; do
  rc=0
  # shellcheck disable=SC2086  # the flags are several words
  timeout 30 "$server" "${base[@]}" $bad > "$work/usage.log" 2>&1 || rc=$?
  if [ "$rc" -eq 2 ] && [ -s "$work/usage.log" ] && ! grep -qv '^mlaverify-server: ' "$work/usage.log"; then
    echo "ok: $bad: $(head -1 "$work/usage.log")"
  else
    echo "FAIL: $bad: exit $rc, lines not all 'mlaverify-server: ...': $(head -3 "$work/usage.log")"
    failures=$((failures + 1))
  fi
done
# --help lists every flag under a group named for what it sets.
"$server" --help > "$work/help.txt"
groups=$(grep -cE '^(Model and KV pool|Devices and execution|Limits|Device-driven steps|Shared memory|gRPC and HTTP/2|Security|Operations):$' "$work/help.txt")
if [ "$groups" -eq 8 ] && ! grep -q '^Options:' "$work/help.txt"; then
  echo "ok: --help lists its flags in 8 groups"
else
  echo "FAIL: --help groups: $groups of 8, or an ungrouped Options list: $(head -5 "$work/help.txt")"
  failures=$((failures + 1))
fi
expect_refused "--idle-timeout-s under a second" "--idle-timeout-s 0.001: need 0 (never) or 1.." \
  --idle-timeout-s 0.001
expect_refused "--idle-timeout-s negative" "--idle-timeout-s" --idle-timeout-s -5
expect_refused "a token file that does not exist" "auth-token-file" --auth-token-file /nonexistent/token
printf 'layers = 2\nlayerz = 3\n' > "$work/typo.toml"
expect_refused "a --config file with an unknown flag name" "layerz: no such flag.*did you mean layers?" \
  --config "$work/typo.toml"
printf 'page-size = 3\n' > "$work/bad.toml"
expect_refused "a --config file with a bad value" "page" --config "$work/bad.toml"

# expect_config_refused "what" "message part" FILE [FLAGS...]: exit 2 with
# exactly one short line (under 300 bytes) on stdout and stderr together.
expect_config_refused() {
  local what=$1 want=$2 file=$3
  shift 3
  local rc=0
  timeout 30 "$server" "${base[@]}" --config "$file" "$@" > "$work/out.log" 2>&1 || rc=$?
  local lines bytes
  lines=$(wc -l < "$work/out.log")
  bytes=$(wc -c < "$work/out.log")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || [ "$bytes" -ge 300 ] ||
    ! grep -q -- "$want" "$work/out.log"; then
    echo "FAIL: $what: exit $rc (want 2), $lines lines, $bytes bytes: $(head -c 300 "$work/out.log")"
    failures=$((failures + 1))
  else
    echo "ok: $what: $(cat "$work/out.log")"
  fi
}
printf 'layers = 2\nheads = 8\nlayers = 3\n' > "$work/dup.toml"
expect_config_refused "a duplicate key" "dup.toml:3:.*layers" "$work/dup.toml"
printf 'layers = 2\ndraft-buckets = [1, 2\n' > "$work/open.toml"
expect_config_refused "an unterminated array at the end" "open.toml:2:.*end-of-file" "$work/open.toml"
printf 'max-live-sequences = 99999999999999999999\n' > "$work/big.toml"
expect_config_refused "an integer beyond 64 bits" "big.toml:1:.*64 bits" "$work/big.toml"
printf 'layers = "two"\n' > "$work/type.toml"
# (${base[@]} sets --layers and --backend on the command line.)
expect_config_refused "a string for an integer flag, the flag also on the command line" \
  "type.toml:1: layers: need an integer, got a string" "$work/type.toml"
printf 'backend = "gpu"\n' > "$work/member.toml"
expect_config_refused "a value the flag refuses, the flag also on the command line" \
  "member.toml:1: --backend: gpu not in" "$work/member.toml"
{
  printf 'listen = "'
  head -c 900000 /dev/zero | tr '\0' x
  printf '"\nlayerz = 1\n'
} > "$work/long.toml"
expect_config_refused "a 900 kB value and an unknown key" "long.toml:2: layerz: no such flag" \
  "$work/long.toml"
head -n 1 "$work/long.toml" > "$work/longlisten.toml"
expect_config_refused "a 900 kB --listen value" "--listen xxxxxxxxxx.*: need host:port" \
  "$work/longlisten.toml"
{
  printf 'layers = '
  head -c 900000 /dev/zero | tr '\0' 9
  printf '\n'
} > "$work/digits.toml"
expect_config_refused "a 900 kB integer" "digits.toml:1:" "$work/digits.toml"
printf 'layers = 2\n[server]\nheads = 8\n' > "$work/table.toml"
expect_config_refused "a [table]" "table.toml:2: server: a table" "$work/table.toml"
printf 'version = true\n' > "$work/version.toml"
expect_config_refused "a flag a file cannot set" "version: no such flag" "$work/version.toml"
expect_refused "a --config file that does not exist" "cannot read config" --config /nonexistent/flags.toml
# A device or a FIFO would hang the flag parser (growing memory on /dev/zero).
expect_refused "--config /dev/zero" "not a regular file" --config /dev/zero
mkfifo "$work/flags.fifo"
expect_refused "--config on a FIFO" "not a regular file" "--config=$work/flags.fifo"
head -c 2000000 /dev/zero | tr '\0' '#' > "$work/huge.toml"
expect_refused "a --config file of 2 MB" "more than 1048576" --config "$work/huge.toml"
printf 'caf\xc3\xa9-token\n' > "$work/utf8.token"
expect_refused "a token that is not visible ASCII" "outside visible ASCII" \
  --auth-token-file "$work/utf8.token"
expect_refused "a token file on a FIFO" "not a regular file" --auth-token-file "$work/flags.fifo"

# --version: name, version, git revision, build; exit 0.
rc=0
"$server" --version > "$work/version.out" 2>&1 || rc=$?
if [ "$rc" -eq 0 ] && grep -qE '^mlaverify-server [0-9]+\.[0-9]+\.[0-9]+ \(git ([0-9a-f]{12}|unknown); .+\)$' \
  "$work/version.out"; then
  echo "ok: --version: $(cat "$work/version.out")"
else
  echo "FAIL: --version: exit $rc: $(cat "$work/version.out")"
  failures=$((failures + 1))
fi

# serve NAME FLAGS...: starts a server, waits until it serves, writes
# `mlaverify-client info --json -` to $work/NAME.json, stops it (exit 0 expected);
# its log is $work/NAME.log.
serve() {
  local name=$1
  shift
  "$server" "${base[@]}" --listen 127.0.0.1:0 --port-file "$work/$name.ports" --drain-grace-s 0 \
    "$@" > "$work/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do [ -s "$work/$name.ports" ] && break; sleep 0.1; done
  local port=""
  [ -s "$work/$name.ports" ] && read -r port _ < "$work/$name.ports"
  "$client" --target "127.0.0.1:${port:-1}" info --json - > "$work/$name.json" 2> "$work/$name.err"
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
}

# check "what" NAME PYTHON-EXPRESSION over `info` (the parsed JSON).
check() {
  local what=$1 name=$2 expr=$3
  if python3 -c "import json,sys; info = json.load(open(sys.argv[1])); sys.exit(0 if ($expr) else 1)" \
    "$work/$name.json" 2>/dev/null; then
    echo "ok: $what"
  else
    echo "FAIL: $what: $(head -c 400 "$work/$name.json") $(tail -3 "$work/$name.log")"
    failures=$((failures + 1))
  fi
}

# Switches: bare is true, a value given with = or as the next argument.
serve bare --allow-client-shm --cuda-graphs
check "--allow-client-shm alone turns it on" bare 'info["client_shared_memory"] is True'
serve eq --allow-client-shm=true --cuda-graphs=false
check "--allow-client-shm=true" eq 'info["client_shared_memory"] is True'
serve space --allow-client-shm false --cuda-graphs true
check "--allow-client-shm false" space 'info["client_shared_memory"] is False'
serve eqfalse --allow-client-shm=false
check "--allow-client-shm=false" eqfalse 'info["client_shared_memory"] is False'

# Sizes say which unit they took: SI prefixes are powers of 1000, binary
# ones (KiB, MiB, GiB) of 1024.
serve si --max-message-bytes 2MB
check "--max-message-bytes 2MB is 2,000,000 bytes" si 'info["max_message_bytes"] == 2000000'
serve binary --max-message-bytes 2MiB
check "--max-message-bytes 2MiB is 2,097,152 bytes" binary 'info["max_message_bytes"] == 2097152'

# A good --config file applies, the command line wins over it, and
# --log-format json makes every log line a JSON object.
printf '# flags for the test\nlayers = 3\nheads = 4\nallow-client-shm = true\ndraft-buckets = [1, 2, 4]\nlog-format = "json"\n' \
  > "$work/good.toml"
serve config --config "$work/good.toml"
check "a good --config file, --layers 2 on the command line winning over its 3" config \
  'info["num_layers"] == 2 and info["num_heads"] == 4 and info["client_shared_memory"] is True and info["max_draft_len"] == 4'
if python3 - "$work/config.log" <<'PY'; then
import json, sys
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
assert len(lines) >= 2, lines
for line in lines:
    record = json.loads(line)
    # The four always; a record written inside a ScopedLogFields also its
    # fields (common/log_fields.h).
    assert {"time", "level", "thread", "msg"} <= set(record) <= {
        "time", "level", "thread", "msg", "source", "rpc", "code", "peer", "sequence", "step",
        "duration_ms"}, record
assert any("ready" in json.loads(l)["msg"] for l in lines), lines
PY
  echo "ok: --log-format json from the --config file: every line parses"
else
  echo "FAIL: --log-format json: $(head -5 "$work/config.log")"
  failures=$((failures + 1))
fi
printf '\xef\xbb\xbfheads = 4\n' > "$work/bom.toml"
serve bom --config "$work/bom.toml"
check "a --config file with a UTF-8 byte order mark" bom 'info["num_heads"] == 4'

# A port in use by another server is refused.
"$server" "${base[@]}" --listen 127.0.0.1:0 --port-file "$work/ports" > "$work/holder.log" 2>&1 &
holder=$!
for _ in $(seq 1 100); do [ -s "$work/ports" ] && break; sleep 0.1; done
read -r port _ < "$work/ports"
expect_refused "a port another server listens on" "cannot listen" --listen "127.0.0.1:$port"
# gRPC's own error lines about it go through the server's log too: with
# --log-format json every line is a JSON object, gRPC's included.
expect_refused "gRPC's log lines in the server's log" '"msg":"grpc ' --listen "127.0.0.1:$port" \
  --log-format json
if python3 -c "import json,sys; [json.loads(l) for l in open(sys.argv[1]) if l.strip()]" \
  "$work/out.log" 2>/dev/null; then
  echo "ok: every line JSON, gRPC's included"
else
  echo "FAIL: a line that is not JSON with --log-format json: $(head -c 300 "$work/out.log")"
  failures=$((failures + 1))
fi
kill -TERM "$holder"
wait "$holder"
holder=""

# A second SIGTERM during the drain exits at once (status 1) instead of
# waiting out a 30-s grace.
"$server" "${base[@]}" --listen 127.0.0.1:0 --port-file "$work/ports2" --drain-grace-s 30 \
  > "$work/twice.log" 2>&1 &
twice=$!
for _ in $(seq 1 100); do [ -s "$work/ports2" ] && break; sleep 0.1; done
kill -TERM "$twice"
sleep 0.5
start=$(date +%s)
kill -TERM "$twice"
rc=0
wait "$twice" || rc=$?
took=$(($(date +%s) - start))
if [ "$rc" -eq 1 ] && [ "$took" -le 5 ] && grep -q "during the drain: exiting now" "$work/twice.log"; then
  echo "ok: a second SIGTERM exits at once (status $rc after ${took} s)"
else
  echo "FAIL: a second SIGTERM: status $rc after ${took} s: $(tail -2 "$work/twice.log")"
  failures=$((failures + 1))
fi

if [ "$failures" -ne 0 ]; then
  echo "server flags test FAILED ($failures)"
  exit 1
fi
echo "server flags test passed"
