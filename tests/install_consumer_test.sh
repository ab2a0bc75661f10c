#!/usr/bin/env bash
# `cmake --install` as a scheduler's build meets it: the client and runtime
# components go into a scratch prefix; a project of its own
# (tests/install_consumer/) is built against the installed CMake package
# (find_package(mlaverify CONFIG), mlaverify::client) and, the same source,
# through pkg-config (mlaverify-client.pc); both binaries then talk to the
# installed mlaverify-server. Nothing of the package may name the source or
# build tree.
#   tests/install_consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(realpath "$1")
src=$(realpath "$2")
work=$(mktemp -d /tmp/mlaverify-install-test.XXXXXX)
server_pid=""
trap '[ -n "$server_pid" ] && kill -9 "$server_pid" 2>/dev/null; rm -rf "$work"' EXIT
fail() {
  echo "install consumer test FAILED: $*" >&2
  exit 1
}
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" --component client > "$work/install.log"
cmake --install "$build" --prefix "$prefix" --component runtime >> "$work/install.log"
for f in bin/mlaverify-server bin/mlaverify-client include/mlaverify/client/client.h \
         include/mlaverify/mlaverify/v1/verify.grpc.pb.h include/mlaverify/grpc/health/v1/health.pb.h \
         include/mlaverify/common/build_info.h; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
[ ! -e "$prefix/include/grpc" ] || fail "headers landed in include/grpc, gRPC's own folder"
config=$(find "$prefix" -name mlaverifyConfig.cmake | head -1)
pc=$(find "$prefix" -name mlaverify-client.pc | head -1)
if [ -z "$config" ] || [ -z "$pc" ]; then fail "no CMake package or pkg-config module installed"; fi
if grep -rlF -e "$src" -e "$build" "$(dirname "$config")" "$pc"; then
  fail "the package names the source or build tree"
fi
echo "ok: installed into a scratch prefix ($(find "$prefix" -type f | wc -l) files)"

# The CMake package.
cmake -S "$src/tests/install_consumer" -B "$work/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release > "$work/consumer-configure.log" 2>&1 ||
  { tail -20 "$work/consumer-configure.log"; fail "find_package(mlaverify) did not configure"; }
cmake --build "$work/consumer-build" -j2 > "$work/consumer-build.log" 2>&1 ||
  { tail -20 "$work/consumer-build.log"; fail "the consumer did not build against mlaverify::client"; }
echo "ok: a project of its own built with find_package(mlaverify CONFIG) and mlaverify::client"

# pkg-config, the same source.
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
# shellcheck disable=SC2046 # word splitting of the flags is intended
c++ -std=c++17 -O1 "$src/tests/install_consumer/consumer.cc" -o "$work/consumer-pc" \
  $(pkg-config --cflags --libs mlaverify-client) 2> "$work/pc-build.log" ||
  { tail -20 "$work/pc-build.log"; fail "the consumer did not build through pkg-config"; }
echo "ok: built through pkg-config ($(pkg-config --modversion mlaverify-client))"

# Both against the installed server.
"$prefix/bin/mlaverify-server" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
  --port-file "$work/ports" --backend cpu --layers 3 --heads 4 --page-size 16 --pool-bytes 32MiB \
  --cpu-threads 1 --drain-grace-s 0 > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do
  [ -s "$work/ports" ] && break
  sleep 0.1
done
[ -s "$work/ports" ] || { tail -5 "$work/server.log"; fail "the installed server did not start"; }
read -r grpc_port _ < "$work/ports"
for consumer in "$work/consumer-build/consumer" "$work/consumer-pc"; do
  out=$("$consumer" "127.0.0.1:$grpc_port") || fail "$consumer: $out"
  [ "$out" = "consumer ok: 3 layers, 4 heads, sequence released" ] || fail "$consumer printed: $out"
  echo "ok: $(basename "$consumer"): $out"
done
kill -TERM "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=""
echo "install consumer test passed"
