#!/usr/bin/env bash
# Split-heuristic sweep (min_chunk_tiles x ctas_per_sm) on a few shapes. GPU
# machine, over the bundle of bench/gpu_run.sh:  OUT=/tmp/o bench/research/tune_split.sh
# (writes $OUT/tune.tgz).
set -uo pipefail
export LD_LIBRARY_PATH=.device/bundle/lib
b=.device/bundle/bin/mlaverify-bench
o=$(mktemp -d)
for mc in 1 2 4 8; do for cps in 1 2; do
  echo "== min_chunk_tiles=$mc ctas_per_sm=$cps"
  timeout 100 "$b" --reps 30 --min-chunk-tiles "$mc" --ctas-per-sm "$cps" --shape 1,4096,16,8 --shape 1,65536,16,8 --shape 32,65536,4,8,1 --shape 32,65536,4,8,64 2>&1 | grep -E '^B='
done; done | tee "$o/tune.log"
tar -C "$o" -czf "$OUT/tune.tgz" .
