#!/usr/bin/env bash
# One full measurement call on a GPU machine, from the repository root, over a
# bundle made here by
#   scripts/bundle.sh .device/bundle build/tests/gpu_kernels_test \
#     build/tests/gpu_engine_test build/bench/mlaverify-bench \
#     build/server/mlaverify-server build/client/mlaverify-client
# and carried there (device tool: carry [".device"]):
#   OUT=/tmp/out bench/gpu_run.sh [tests] [service] [anchor] [sweep] [triton] [variants] [stalls] [small] [pdl] [ncu] [shapes] [sass] [timeline]
# Writes logs and JSON into $OUT/results.tgz (one file: the device tool brings
# back at most 8); prints a short summary last.
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
final=${OUT:-/tmp/mlaverify-gpu-out}
out=$(mktemp -d /tmp/mlaverify-run.XXXX)
mkdir -p "$final"
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests anchor sweep triton)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv | tee "$out/nvidia_smi.csv"
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-resource-usage "$bundle/bin/mlaverify-bench" > "$out/resource_usage.txt" 2>&1
fi
summary=()
if want tests; then
  timeout 300 "$bundle/bin/gpu_kernels_test" --gtest_output=json:"$out/gpu_tests.json" \
    > "$out/gpu_tests.log" 2>&1
  rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|rel_err' "$out/gpu_tests.log" | head -30
  summary+=("gpu kernel tests rc=$rc")
  if [ -x "$bundle/bin/gpu_engine_test" ]; then
    timeout 200 "$bundle/bin/gpu_engine_test" > "$out/gpu_engine_test.log" 2>&1
    rc=$?
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure' "$out/gpu_engine_test.log" | head -20
    summary+=("gpu engine test rc=$rc")
  fi
fi
if want service && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The service on the GPU: the bundled server with the CUDA backend, the
  # client's checked demo, then a load run.
  "$bundle/bin/mlaverify-server" --listen 127.0.0.1:0 --admin-host 127.0.0.1 --admin-port 0 \
    --port-file "$out/ports" --backend cuda --layers 61 --heads 8 --page-size 64 \
    --pool-bytes 16GiB --slow-call-ms 20 > "$out/gpu_server.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 300); do [ -s "$out/ports" ] && break; sleep 0.1; done
  read -r gport aport < "$out/ports"
  cl=("$bundle/bin/mlaverify-client" --target "127.0.0.1:$gport")
  timeout 120 "${cl[@]}" demo --sequences 4 --prompt-len 4000 --steps 4 --drafts 16 \
    > "$out/gpu_demo.log" 2>&1
  summary+=("gpu service demo rc=$?")
  tail -14 "$out/gpu_demo.log"
  timeout 120 "${cl[@]}" load --concurrency 32 --duration-s 20 --warmup-s 2 --prompt-len 1024 \
    --drafts 16 --json "$out/gpu_load.json" > "$out/gpu_load.log" 2>&1
  summary+=("gpu service load rc=$?")
  tail -9 "$out/gpu_load.log"
  curl -s "http://127.0.0.1:$aport/metrics" > "$out/gpu_metrics.txt" || true
  kill -TERM $spid; wait $spid; summary+=("gpu server exit=$?")
  head -3 "$out/gpu_server.log"; grep -c "slow " "$out/gpu_server.log"; grep "slow " "$out/gpu_server.log" | head -5; tail -2 "$out/gpu_server.log"
fi
if want anchor; then
  timeout 450 "$bundle/bin/mlaverify-bench" --suite anchor --out "$out/anchor.json" 2>&1 |
    tee "$out/anchor.log"
  summary+=("anchor rc=${PIPESTATUS[0]}")
fi
if want sweep; then
  timeout 200 "$bundle/bin/mlaverify-bench" --suite sweep --out "$out/sweep.json" 2>&1 |
    tee "$out/sweep.log"
  summary+=("sweep rc=${PIPESTATUS[0]}")
fi
if want shapes; then
  args=()
  for s in ${SHAPES:-}; do args+=(--shape "$s"); done
  timeout 300 "$bundle/bin/mlaverify-bench" "${args[@]}" --out "$out/shapes.json" 2>&1 |
    tee "$out/shapes.log"
  summary+=("shapes rc=${PIPESTATUS[0]}")
fi
if want variants; then
  # The attention variants side by side on the four target shapes.
  for v in ${VARIANTS:-splitk8 splitk16 pipelined pipelined16}; do
    echo "== variant $v"
    timeout 200 "$bundle/bin/mlaverify-bench" --variant $v --shape 1,4096,16,8 --shape 1,65536,16,8 \
      --shape 32,65536,4,8 --shape 8,65536,16,16 --shape 32,65536,4,8,1 \
      --out "$out/variant-$v.json" 2>&1 | grep -E '^B='
  done 2>&1 | tee "$out/variants.log"
fi
if want small; then
  # Small batch, default kernel: the split knobs (lead 1 of bench/NOTES.md).
  for flags in "" "--ctas-per-sm 2 --min-chunk-tiles 4" "--min-chunk-tiles 4" "--min-chunk-tiles 1" "--pdl"; do
    echo "== flags: ${flags:-default}"
    timeout 120 "$bundle/bin/mlaverify-bench" --shape 1,4096,16,8 --shape 1,65536,16,8 $flags 2>&1 |
      grep -E '^B='
  done 2>&1 | tee "$out/small.log"
fi
if want pdl; then
  # Programmatic dependent launch on and off: the whole anchor suite with
  # it (compare with anchor.json, run with the default: off), then small
  # shapes warm and cold.
  timeout 300 "$bundle/bin/mlaverify-bench" --suite anchor --pdl --out "$out/anchor_pdl.json" \
    > "$out/anchor_pdl.log" 2>&1
  summary+=("anchor --pdl rc=$?")
  grep -E '^B=.*tree' "$out/anchor_pdl.log"
  for flags in "--pdl" "--no-pdl" "--pdl --no-flush" "--no-pdl --no-flush"; do
    echo "== flags: ${flags:-default}"
    timeout 120 "$bundle/bin/mlaverify-bench" --shape 1,1024,16,8 --shape 1,4096,16,8 $flags 2>&1 |
      grep -E '^B='
  done 2>&1 | tee "$out/pdl.log"
fi
if want ncu && command -v ncu >/dev/null; then
  # Per-kernel durations at the small shape, then the attention kernel's
  # pipes and stall reasons at a compute-heavy one.
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum \
    -k regex:'PlanKernel|AttentionKernel|CombineKernel' --launch-skip 6 --launch-count 6 \
    "$bundle/bin/mlaverify-bench" --shape 1,4096,16,8 --reps 3 > "$out/ncu_small.txt" 2>&1
  grep -E 'Kernel|gpu__time_duration' "$out/ncu_small.txt" | head -24
  timeout 300 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
    -k regex:AttentionKernel --launch-skip 2 --launch-count 1 \
    "$bundle/bin/mlaverify-bench" --shape 8,16384,16,8 --reps 3 > "$out/ncu_mid.txt" 2>&1
  grep -E 'Throughput|Pipe|Stall|stall|Issue|Warp Cycles|Active|Shared|Bank|Occupancy|Registers|Duration' \
    "$out/ncu_mid.txt" | head -60
fi
if want timeline && command -v ncu >/dev/null; then
  # Small batch, where launches and tails cost more than the work: each
  # kernel's duration without cache flushes between kernels (ncu
  # --cache-control none: the partials stay in L2 as in a real replay).
  timeout 200 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    -k regex:'PlanKernel|AttentionKernel|CombineKernel' --launch-skip 6 --launch-count 6 \
    "$bundle/bin/mlaverify-bench" --shape ${TIMELINE_SHAPE:-1,4096,16,8} --reps 3 \
    > "$out/ncu_small_nocache.txt" 2>&1
  grep -E 'Kernel|gpu__time_duration' "$out/ncu_small_nocache.txt" | head -24
fi
if want stalls && command -v ncu >/dev/null; then
  # Where the warps of one attention variant wait: warp-state statistics and
  # per-SASS-instruction stall samples (source page as CSV) at one shape.
  variant=${VARIANT:-pipelined}
  shape=${STALL_SHAPE:-8,16384,16,8}
  # STALL_SAMPLING=0 samples every 32 cycles (small launches need it).
  sampling=()
  [ -n "${STALL_SAMPLING:-}" ] && sampling=(--warp-sampling-interval "$STALL_SAMPLING")
  timeout 300 ncu --clock-control none --section WarpStateStats --section SourceCounters "${sampling[@]}" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --import-source no -k regex:Attention --launch-skip 2 --launch-count 1 -o "$out/stalls" \
    "$bundle/bin/mlaverify-bench" --variant "$variant" --shape "$shape" --reps 3 \
    > "$out/stalls_run.txt" 2>&1
  ncu -i "$out/stalls.ncu-rep" --print-details all > "$out/stalls_details.txt" 2>&1
  ncu -i "$out/stalls.ncu-rep" --page source --csv --print-source sass > "$out/stalls_sass.csv" 2>&1
  grep -E 'Throughput|Pipe|Stall|stall|Issue|Warp Cycles|Eligible|Active|Duration' \
    "$out/stalls_details.txt" | head -40
  wc -l "$out/stalls_sass.csv"; head -3 "$out/stalls_sass.csv" | cut -c1-600
  python3 bench/sass_profile.py "$out/stalls_sass.csv" --regions 0x1000 > "$out/stalls_regions.txt" 2>&1
  python3 bench/sass_profile.py "$out/stalls_sass.csv" --loops > "$out/stalls_loops.txt" 2>&1
  grep -E "^== |stalls:" "$out/stalls_loops.txt"
  tail -12 "$out/stalls_regions.txt"
fi
if want sass && command -v cuobjdump >/dev/null; then
  # The attention kernels' SASS (instruction counts per loop, scheduling).
  cuobjdump -sass -arch sm_90 "$bundle/bin/mlaverify-bench" > "$out/sass_sm90.txt" 2>&1
  summary+=("sass rc=$? ($(wc -l < "$out/sass_sm90.txt") lines)")
  # Instructions and WARPSYNC per tile loop of every attention kernel: compare
  # with the previous build's before reading an A/B (bench/NOTES.md v8.2).
  python3 bench/sass_loops.py "$out/sass_sm90.txt" > "$out/sass_loops.txt" 2>&1
  cat "$out/sass_loops.txt"
fi
if want triton; then
  # Our own Triton implementation of the SGLang-style extend path, same shapes.
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/baselines/triton_extend.py --suite anchor \
    --out "$out/triton_anchor.json" > "$out/triton.log" 2>&1
  rc=$?
  tail -35 "$out/triton.log"
  summary+=("triton anchor rc=$rc")
  if want sweep; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/baselines/triton_extend.py --shapes \
      1,1024,16,8 1,2048,16,8 1,4096,16,8 1,8192,16,8 1,16384,16,8 1,32768,16,8 1,65536,16,8 \
      1,131072,16,8 --out "$out/triton_sweep.json" > "$out/triton_sweep.log" 2>&1
    summary+=("triton sweep rc=$?")
  fi
fi
printf '%s\n' "${summary[@]}"
# At most 8 files come back from the device machine: pack everything into one.
tar -C "$out" -czf "$final/results.tgz" .
