#!/usr/bin/env bash
# The engine's options side by side in one device call: one item in flight and
# 64 threads, each row the same binary with one option changed. Over a bundle
# (scripts/bundle.sh .device/bundle build/bench/mlaverify-engine-bench ...):
#   OUT=/tmp/out bench/engine_ab.sh        → $OUT/ab.json, printed rows
set -o pipefail
bundle=${BUNDLE:-.device/bundle}
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
b=$bundle/bin/mlaverify-engine-bench
out=${OUT:-/tmp/mlaverify-ab}
mkdir -p "$out"
run() {
  timeout 120 "$b" --devices 0 --duration-s 4 --warmup-s 1 --pool-bytes 80GiB --json "$out/ab.json" "$@" 2>&1 |
    grep -E "^single|engine:"
}
echo "== default"; run --prefix-len 1024,16384 --threads 1,64
echo "== device inputs"; run --prefix-len 1024,16384 --threads 1,64 --inputs device
echo "== one launch in flight"; run --prefix-len 1024 --threads 64 --batches-in-flight 1
echo "== three launches in flight"; run --prefix-len 1024 --threads 64 --batches-in-flight 3
echo "== copy threads 8"; run --prefix-len 1024 --threads 64 --copy-threads 8
echo "== graphs off"; run --prefix-len 16384 --threads 1 --cuda-graphs false
