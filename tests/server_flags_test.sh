#!/usr/bin/env bash
# Bad flags and addresses: each is a clear message and exit status 2, never a
# crash; a port another server holds is refused, never shared (no
# SO_REUSEPORT).
#   tests/server_flags_test.sh BUILD_DIR
set -uo pipefail
server=$1/server/mlaverify-server
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
expect_refused "--copy-threads 0" "copy_threads" --copy-threads 0
expect_refused "heads that do not split over the devices" "does not split" --heads 7 --devices 0,0
expect_refused "--stream-max-in-flight 0" "stream-max-in-flight" --stream-max-in-flight 0
expect_refused "an unknown flag" "workers" --workers 8
expect_refused "a token file that does not exist" "auth-token-file" --auth-token-file /nonexistent/token
printf 'layers = 2\nlayerz = 3\n' > "$work/typo.toml"
expect_refused "a --config file with an unknown flag name" "layerz" --config "$work/typo.toml"
printf 'page-size = 3\n' > "$work/bad.toml"
expect_refused "a --config file with a bad value" "page" --config "$work/bad.toml"
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

# A port in use by another server is refused.
"$server" "${base[@]}" --listen 127.0.0.1:0 --port-file "$work/ports" > "$work/holder.log" 2>&1 &
holder=$!
for _ in $(seq 1 100); do [ -s "$work/ports" ] && break; sleep 0.1; done
read -r port _ < "$work/ports"
expect_refused "a port another server listens on" "cannot listen" --listen "127.0.0.1:$port"
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
