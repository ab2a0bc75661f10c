#!/usr/bin/env bash
# Side-by-side timing of several bench binaries (or flag sets) in one device
# call, on the target shapes: the A/B comparisons of bench/NOTES.md. Run on
# the GPU machine from the repository root over a bundle (scripts/bundle.sh)
# into which the older binaries were copied under other names, e.g.
# .device/bundle/bin/mlaverify-bench-v5:
#   bench/research/ab.sh OUT_LOG "v5|mlaverify-bench-v5|" "v6|mlaverify-bench|" \
#     "v6-plan-kernel|mlaverify-bench|--plan-kernel"
# PASSES (default 2) alternates the binaries that many times; AB_SHAPES
# replaces the shape list.
set -uo pipefail
out=$1
shift
bundle=${BUNDLE:-.device/bundle}
shapes=(--shape "1,4096,16,8" --shape "1,65536,16,8" --shape "8,16384,16,8" --shape "32,65536,4,8"
        --shape "32,65536,4,8,1" --shape "8,65536,16,16")
# AB_SHAPES="B,L,N,H[,page] ..." replaces the list.
if [ -n "${AB_SHAPES:-}" ]; then
  shapes=()
  for s in $AB_SHAPES; do shapes+=(--shape "$s"); done
fi
for ((i = 0; i < ${PASSES:-2}; ++i)); do
  for spec in "$@"; do
    IFS='|' read -r label bin flags <<< "$spec"
    echo "== $label"
    # shellcheck disable=SC2086  # flags are words
    LD_LIBRARY_PATH=$bundle/lib timeout 100 "$bundle/bin/$bin" "${shapes[@]}" $flags 2>&1 |
      grep -E '^B=|rror'
  done
done 2>&1 | tee "$out"
