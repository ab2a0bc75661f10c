#!/usr/bin/env bash
# Knockout matrix of the `pipelined` tile loop (bench/NOTES.md session 8):
# builds of mlaverify-bench with parts of the loop removed
# (cmake -DMLAVERIFY_KNOCKOUT=bits, see kernels/verify_pipelined_kernel.cuh:
# 1 loop KV loads, 2 PV MMAs, 4 score MMAs, 8 the score pair's exchange,
# 16 the softmax's exponentials, 32 the alpha check), timed beside the
# unmodified bench. Their results are wrong by design (the rows print
# FAILED CHECK); only the times are read.
#
#   here:        bench/knockouts.sh build BUNDLE BITS...   (sm_90 only, ~1 min per build)
#   GPU machine: bench/knockouts.sh run OUT_DIR BITS...    (over that bundle)
#
# `build` adds BUNDLE/bin/mlaverify-bench-ko<bits> beside the bundle's
# mlaverify-bench (bundle that first with scripts/bundle.sh). `run` times all
# of them on KO_SHAPES (default: the compute-bound, long fused and stream
# shapes) and writes each build's tile loops (sass_loops.py: instruction,
# HMMA, LDSM counts), so a knockout that changed more than it meant to shows.
set -euo pipefail
mode=${1:-}
if [ $# -lt 3 ] || { [ "$mode" != build ] && [ "$mode" != run ]; }; then
  echo "usage: $0 build BUNDLE BITS... | $0 run OUT_DIR BITS..." >&2
  exit 2
fi
dir=$2
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ "$mode" = build ]; then
  for bits in "$@"; do
    build=${KO_BUILD_ROOT:-/tmp}/mlaverify-build-ko$bits
    cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real \
      -DMLAVERIFY_KNOCKOUT="$bits" > "$build.configure.log" 2>&1
    cmake --build "$build" -j"$(nproc)" --target mlaverify-bench > "$build.build.log" 2>&1
    cp -f "$build/bench/mlaverify-bench" "$dir/bin/mlaverify-bench-ko$bits"
    echo "built knockout $bits -> $dir/bin/mlaverify-bench-ko$bits"
  done
  exit 0
fi
bundle=${BUNDLE:-.device/bundle}
mkdir -p "$dir"
specs=("main|mlaverify-bench|")
for bits in "$@"; do specs+=("ko$bits|mlaverify-bench-ko$bits|"); done
AB_SHAPES=${KO_SHAPES:-"8,65536,16,16 1,65536,16,8 32,65536,4,8"} PASSES=1 \
  "$repo/bench/ab.sh" "$dir/knockouts.log" "${specs[@]}" > /dev/null 2>&1 || true
cat "$dir/knockouts.log"
if command -v cuobjdump > /dev/null; then
  for spec in "${specs[@]}"; do
    IFS='|' read -r label bin _ <<< "$spec"
    cuobjdump -sass -arch sm_90 "$bundle/bin/$bin" > "$dir/sass-$label.txt" 2>&1 || true
    python3 "$repo/bench/sass_loops.py" "$dir/sass-$label.txt" > "$dir/sass-loops-$label.txt" 2>&1 || true
    echo "== tile loops, $label (pipelined, register page path)"
    grep -A4 'PipelinedAttentionKernelILi2ELb0ELb0E' "$dir/sass-loops-$label.txt" | tail -4
    gzip -f "$dir/sass-$label.txt"
  done
fi
