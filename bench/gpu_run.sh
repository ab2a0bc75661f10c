#!/usr/bin/env bash
# One full measurement call on a GPU machine, from the repository root, over a
# bundle made here by
#   scripts/bundle.sh .device/bundle build/tests/gpu_kernels_test \
#     build/tests/gpu_engine_test build/bench/mlaverify-bench build/bench/mlaverify-engine-bench \
#     build/server/mlaverify-server build/client/mlaverify-client
# and carried there (device tool: carry [".device"]):
#   OUT=/tmp/out bench/gpu_run.sh [mps] [tests] [steps] [fp8] [dataplane] [completion] [service] [connections] [planes] [cudashm] [pyclient] [pynative] [latency] [fault] [engine] [soak] [anchor] [sweep] [triton] [stalls] [small] [pdl] [ncu] [shapes] [sass] [timeline]
# The pyclient part also needs the Python package with its stubs in the
# bundle: cp -r build/client/python .device/bundle/python
# Writes logs and JSON into $OUT/results.tgz (one file: the device tool brings
# back at most 8); prints a short summary last.
set -uo pipefail
# Absolute: parts run scripts that change directory (tests/python_cuda_shm_gpu.sh).
bundle=$(realpath "${BUNDLE:-.device/bundle}")
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
# results.tgz is packed at the end only; the reports are written into the
# run folder as each run ends. Under a time limit, pack that folder whatever
# happens: timeout 300 bench/gpu_run.sh ...; tar czf "$OUT/runs.tgz" /tmp/mlaverify-run.*
echo "gpu_run.sh: reports in $out" >&2
if want mps; then
  # Every process of the parts that follow runs as a client of one CUDA MPS
  # server (one GPU context for all): kernels of the service and of its
  # schedulers run side by side instead of time-sliced. The daemon's pipe
  # and logs live in the run folder; it quits when the script ends.
  export CUDA_MPS_PIPE_DIRECTORY=$out/mps-pipe CUDA_MPS_LOG_DIRECTORY=$out/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    summary+=("mps: control daemon started")
  else
    summary+=("mps: nvidia-cuda-mps-control -d failed; the parts run without MPS")
  fi
fi
if want tests; then
  # (the fp8 grid, Fp8AttentionMatchesReferenceOverTheGrid, about doubles the grid's time)
  timeout 420 "$bundle/bin/gpu_kernels_test" --gtest_output=json:"$out/gpu_tests.json" \
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
# start_server TAG LISTEN FLAGS...: the bundled server with the CUDA backend;
# sets $spid, $aport and $cl (the client command). Log: $out/server-TAG.log.
start_server() {
  local tag=$1 listen=$2
  shift 2
  rm -f "$out/ports-$tag"
  "$bundle/bin/mlaverify-server" --listen "$listen" --admin-host 127.0.0.1 --admin-port 0 \
    --port-file "$out/ports-$tag" --backend cuda --layers 61 --page-size 64 --slow-call-ms 20 "$@" \
    > "$out/server-$tag.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 600); do [ -s "$out/ports-$tag" ] && break; sleep 0.1; done
  read -r gport aport < "$out/ports-$tag"
  cl=("$bundle/bin/mlaverify-client" --target "127.0.0.1:$gport")
  # NOT_SERVING until the engine has allocated its pools and recorded its graphs.
  for _ in $(seq 1 1200); do "${cl[@]}" health > /dev/null 2>&1 && break; sleep 0.1; done
  "${cl[@]}" info > "$out/info-$tag.txt" 2>&1
}
stop_server() {
  curl -s "http://127.0.0.1:$aport/metrics" > "$out/metrics-$1.txt" || true
  kill -TERM "$spid"; wait "$spid"; summary+=("server $1 exit=$?")
}
# load_row ROW ARGS...: one load of the client against the server of
# start_server (N=16, with its floor); JSON and log named by ROW.
load_row() {
  local row=$1
  shift
  timeout 100 "${cl[@]}" load --drafts 16 --floor --progress false "$@" \
    --json "$out/planes-$row.json" > "$out/planes-$row.log" 2>&1
  summary+=("load $row rc=$?")
  echo "== $row"
  grep -E "^(verify calls|latency|server split|floor: |append|errors|result)" "$out/planes-$row.log"
}
# mode_flags MODE POOL_GIB: sets $flags, the server flags of one parallel mode
# (single, tp, dp) with POOL_GIB of pool on the one device, halved per worker.
mode_flags() {
  local half=$(($2 / 2))
  case $1 in
    single) flags=(--devices 0 --heads 8 --pool-bytes "${2}GiB") ;;
    tp) flags=(--devices "0,0" --parallel-mode tp --heads 16 --pool-bytes "${half}GiB") ;;
    dp) flags=(--devices "0,0" --parallel-mode dp --heads 8 --pool-bytes "${half}GiB") ;;
  esac
}
if want dataplane && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The engine's data path (bench/NOTES.md, "The data path in the engine"):
  # the engine in process (one item in flight at L=16K, 64 threads at L=1K,
  # inputs in host and in device memory; TP 0,0 against one device at 16
  # heads), the kernel for the same shapes, then the service: every plane's
  # checked demo (unary and stream) in single, TP 0,0 and DP 0,0 modes, and
  # the load rows of each plane with their bare-transport floors, summarised
  # by bench/service_planes.py. DATAPLANE_QUICK=1: a few engine rows and one
  # service row (a first look at a new build); DATAPLANE_ENGINE=0 or
  # DATAPLANE_SERVICE=0 leaves that half out (to split it over two calls).
  quick=${DATAPLANE_QUICK:-0}
  with_engine=${DATAPLANE_ENGINE:-1}
  with_service=${DATAPLANE_SERVICE:-1}
  with_demos=${DATAPLANE_DEMOS:-1}  # 0: the service's load rows without the demos
  with_inline=${DATAPLANE_INLINE:-1}  # 0: no inline load rows
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  secs=5; [ "$quick" = 1 ] && secs=2
  eb() {  # eb JSON ARGS...: one engine-bench invocation appending rows to JSON
    local json=$1
    shift
    timeout 150 "$bundle/bin/mlaverify-engine-bench" --duration-s "$secs" --warmup-s 1 \
      --gpu-name "$gpu" --json "$out/$json" "$@" 2>&1 | tee -a "$out/engine.log" | grep -E "items/s|LEAK|rror"
    summary+=("engine $json $* rc=${PIPESTATUS[0]}")
  }
  for inputs in device host; do
    [ "$with_engine" = 1 ] || continue
    eb engine.json --devices 0 --prefix-len 16384 --threads 1 --pool-bytes 8GiB --inputs $inputs
    eb engine.json --devices 0 --prefix-len 1024 --threads 1,64 --pool-bytes 16GiB --inputs $inputs
  done
  if [ "$quick" != 1 ] && [ "$with_engine" = 1 ]; then
    # TP at equal work: 16 heads on device 0 once, and split over 0 listed twice.
    eb engine-tp.json --devices 0 --heads-per-device 16 --prefix-len 1024 --threads 64 \
      --pool-bytes 16GiB --inputs device
    eb engine-tp.json --devices 0,0 --mode tp --heads-per-device 8 --prefix-len 1024 --threads 64 \
      --pool-bytes 8GiB --inputs device
    eb engine-tp.json --devices 0,0 --mode dp --heads-per-device 8 --prefix-len 1024 --threads 64 \
      --pool-bytes 8GiB --inputs device
    timeout 120 "$bundle/bin/mlaverify-bench" --shape 1,16384,16,8,64,tree --shape 1,1024,16,8,64,tree \
      --shape 32,1024,16,8,64,tree --shape 1,1024,16,16,64,tree --out "$out/planes-kernel.json" \
      > "$out/planes-kernel.log" 2>&1
    summary+=("kernel shapes rc=$?")
    grep -E '^B=' "$out/planes-kernel.log"
  fi
  c1=(--concurrency 1 --duration-s 5 --warmup-s 1 --prompt-len 16384 --max-seq-len 16900)
  c64=(--concurrency 64 --duration-s 6 --warmup-s 1.5 --prompt-len 1024)
  items=(--concurrency 4 --items 32 --duration-s 6 --warmup-s 1.5 --prompt-len 1024)
  for mode in single tp dp; do
    [ "$with_service" = 1 ] || continue
    # DP has demos only.
    [ "$mode" = dp ] && [ "$with_demos" != 1 ] && continue
    mode_flags "$mode" 40
    [ "$quick" = 1 ] && [ "$mode" != single ] && continue
    start_server "dp-$mode" 127.0.0.1:0 "${flags[@]}" --allow-client-shm true
    if [ "$quick" != 1 ] && [ "$with_demos" = 1 ]; then
      for plane in inline shm cuda-shm; do
        for rpc in unary stream; do
          extra=(); [ "$rpc" = stream ] && extra=(--stream)
          timeout 90 "${cl[@]}" demo --sequences 3 --prompt-len 700 --steps 2 --drafts 16 \
            --data-plane $plane "${extra[@]}" > "$out/demo-$mode-$plane-$rpc.log" 2>&1
          summary+=("demo $mode $plane $rpc rc=$?")
          echo "demo $mode $plane $rpc: $(tail -1 "$out/demo-$mode-$plane-$rpc.log")"
        done
      done
    fi
    if [ "$mode" = single ]; then
      load_row "cuda-shm-stream-c1-16k" --stream "${c1[@]}" --data-plane cuda-shm
      if [ "$quick" != 1 ]; then
        load_row "cuda-shm-stream-c4-1k-items32" --stream "${items[@]}" --data-plane cuda-shm
        load_row "cuda-shm-stream-c64-1k" --stream "${c64[@]}" --data-plane cuda-shm
        load_row "shm-stream-c1-16k" --stream "${c1[@]}" --data-plane shm --shm-staging-mib 1200
        load_row "shm-stream-c64-1k" --stream "${c64[@]}" --data-plane shm --shm-staging-mib 72
        if [ "$with_inline" = 1 ]; then
          load_row "inline-stream-c1-16k" --stream "${c1[@]}"
          load_row "inline-stream-c64-1k" --stream "${c64[@]}"
        fi
      fi
    fi
    [ "$mode" = tp ] && load_row "cuda-shm-stream-c64-1k-tp" --stream "${c64[@]}" --data-plane cuda-shm
    stop_server "dp-$mode"
    grep -E "captured|engine:|fault|rror" "$out/server-dp-$mode.log" | head -4
  done
  if [ "$quick" != 1 ] && [ "$with_service" = 1 ]; then
    # The TP row's single-device twin: 16 heads on one device.
    start_server dp-single16 127.0.0.1:0 --devices 0 --heads 16 --pool-bytes 40GiB --allow-client-shm true
    load_row "cuda-shm-stream-c64-1k-single" --stream "${c64[@]}" --data-plane cuda-shm
    stop_server dp-single16
  fi
fi
if want service && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The service on the GPU in each mode: the client's checked demo, then
  # load; single-device also one call in flight at L=16K, unary and stream.
  for mode in single tp dp; do
    [ "$with_service" = 1 ] || continue
    # DP has demos only.
    [ "$mode" = dp ] && [ "$with_demos" != 1 ] && continue
    mode_flags "$mode" 24
    if [ "$mode" = single ]; then
      # Health from the moment the port listens: NOT_SERVING while the pools
      # are allocated and the graphs recorded, then SERVING.
      ( for _ in $(seq 1 400); do
          printf '%s %s\n' "$(date +%s.%N)" "$("$bundle/bin/mlaverify-client" --target 127.0.0.1:50151 \
            --timeout-ms 200 health 2>&1 | tail -1)"
          sleep 0.02
        done ) > "$out/health-startup.log" 2>&1 &
      hpid=$!
      start_server "$mode" 127.0.0.1:50151 "${flags[@]}"
      kill $hpid 2>/dev/null; wait $hpid 2>/dev/null
      echo "health while starting:"; uniq -c -f1 "$out/health-startup.log" | head -6
    else
      start_server "$mode" 127.0.0.1:0 "${flags[@]}"
    fi
    timeout 180 "${cl[@]}" demo --sequences 4 --prompt-len 4000 --steps 4 --drafts 16 \
      > "$out/demo-$mode.log" 2>&1
    summary+=("demo $mode rc=$?")
    tail -1 "$out/demo-$mode.log"
    timeout 120 "${cl[@]}" load --concurrency 64 --duration-s 15 --warmup-s 2 --prompt-len 1024 \
      --drafts 16 --json "$out/load-$mode-c64.json" > "$out/load-$mode-c64.log" 2>&1
    summary+=("load $mode c64 rc=$?")
    tail -9 "$out/load-$mode-c64.log"
    if [ "$mode" = single ]; then
      for rpc in unary stream; do
        extra=(); [ "$rpc" = stream ] && extra=(--stream)
        timeout 150 "${cl[@]}" load --concurrency 1 --duration-s 8 --warmup-s 1 --prompt-len 16384 \
          --drafts 16 "${extra[@]}" --json "$out/load-single-c1-16k-$rpc.json" \
          > "$out/load-single-c1-16k-$rpc.log" 2>&1
        summary+=("load single c1 16k $rpc rc=$?")
        tail -4 "$out/load-single-c1-16k-$rpc.log"
      done
    fi
    stop_server "$mode"
    grep -E "captured|engine ready|stopped" "$out/server-$mode.log" | head -4
  done
fi
if want connections && [ -x "$bundle/bin/mlaverify-server" ]; then
  # HTTP/2 connections per client (--connections 1, 4, 16, 64): 64 streams of
  # inline Verify at L=1K and one stream at L=16K, 61 layers x 8 heads, N=16,
  # each followed in the same call by its bare-transport floor over the same
  # number of connections (load --floor), then the kernel for the shapes.
  # About 3 minutes. Summarised by bench/service_connections.py into
  # bench/results/service-<gpu>-<date>-connections.json. CONNECTIONS="1 16"
  # picks the counts; CONNECTIONS_SERVER_FLAGS adds server flags (a server
  # tuning to compare, e.g. "--http2-max-concurrent-streams 1024").
  # shellcheck disable=SC2086  # the extra flags are several words
  start_server conns 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 40GiB ${CONNECTIONS_SERVER_FLAGS:-}
  for n in ${CONNECTIONS:-1 4 16 64}; do
    for row in "c64-1k:--concurrency 64 --duration-s 4 --warmup-s 1 --prompt-len 1024" \
               "c1-16k:--concurrency 1 --duration-s 3 --warmup-s 0.5 --prompt-len 16384 --max-seq-len 16900"; do
      name=${row%%:*}
      # shellcheck disable=SC2086  # the row's flags are several words
      timeout 80 "${cl[@]}" --connections "$n" load --drafts 16 --floor --progress false --stream \
        ${row#*:} --json "$out/conns-stream-$name-n$n.json" > "$out/conns-stream-$name-n$n.log" 2>&1
      summary+=("load stream $name connections $n rc=$?")
      echo "== stream $name connections $n"
      grep -E "^(verify calls|latency|floor: |errors|result)" "$out/conns-stream-$name-n$n.log"
    done
  done
  stop_server conns
  timeout 60 "$bundle/bin/mlaverify-bench" --shape 1,16384,16,8,64,tree --shape 1,1024,16,8,64,tree \
    --out "$out/conns-kernel.json" > "$out/conns-kernel.log" 2>&1
  summary+=("kernel shapes rc=$?")
  python3 bench/service_connections.py --dir "$out" --out "$out/service-connections.json"
fi
if want planes && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The data planes (inline and system shared memory) on one GPU, 61 layers x
  # 8 heads, page 64, N=16 trees: the checked demo on each plane, then load
  # with the bare-transport floor measured after each row (load --floor):
  # one call in flight at L=16K, 64 workers at L=1K, and 4 workers of 32
  # items per call at L=1K (a scheduler verifying its batch), unary and
  # stream; AppendKv in smaller messages; a longer worker spin; the kernel's
  # time for the shapes. Summarised by bench/service_planes.py into
  # bench/results/service-<gpu>-<date>.json.
  df -h /dev/shm | tail -1
  start_server planes 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 40GiB --allow-client-shm true
  # PLANES_QUICK=1: the load rows and the kernel only (no demos, no A/B rows).
  quick=${PLANES_QUICK:-0}
  for plane in inline shm; do
    for rpc in unary stream; do
      [ "$quick" = 1 ] && continue
      extra=(); [ "$rpc" = stream ] && extra=(--stream)
      timeout 120 "${cl[@]}" demo --sequences 4 --prompt-len 4000 --steps 2 --drafts 16 \
        --data-plane $plane "${extra[@]}" > "$out/demo-$plane-$rpc.log" 2>&1
      summary+=("demo $plane $rpc rc=$?")
      tail -1 "$out/demo-$plane-$rpc.log"
    done
  done
  # The shm rows make the whole prompt in the region (--shm-staging-mib
  # above its 1.15 GB at L=16K, 70 MB at L=1K): AppendKv of one reference,
  # copied to the device by DMA from the pinned region.
  c1=(--concurrency 1 --duration-s 5 --warmup-s 1 --prompt-len 16384 --max-seq-len 16900)
  c64=(--concurrency 64 --duration-s 6 --warmup-s 1.5 --prompt-len 1024)
  items=(--concurrency 4 --items 32 --duration-s 6 --warmup-s 1.5 --prompt-len 1024)
  for rpc in unary stream; do
    extra=(); [ "$rpc" = stream ] && extra=(--stream)
    load_row "inline-$rpc-c1-16k" "${c1[@]}" "${extra[@]}"
    load_row "shm-$rpc-c1-16k" "${c1[@]}" "${extra[@]}" --data-plane shm --shm-staging-mib 1200
    load_row "inline-$rpc-c64-1k" "${c64[@]}" "${extra[@]}"
    load_row "shm-$rpc-c64-1k" "${c64[@]}" "${extra[@]}" --data-plane shm --shm-staging-mib 72
    load_row "inline-$rpc-c4-1k-items32" "${items[@]}" "${extra[@]}"
    load_row "shm-$rpc-c4-1k-items32" "${items[@]}" "${extra[@]}" --data-plane shm --shm-staging-mib 72
  done
  if [ "$quick" != 1 ]; then
    # Inline AppendKv in 16 MiB messages instead of the server's 64 MiB limit.
    cl_small=("${cl[@]}" --max-message-mib 16)
    cl_saved=("${cl[@]}"); cl=("${cl_small[@]}")
    load_row "inline-stream-c1-16k-chunks16mib" "${c1[@]}" --stream
    cl=("${cl_saved[@]}")
  fi
  stop_server planes
  timeout 120 "$bundle/bin/mlaverify-bench" --shape 1,16384,16,8,64,tree --shape 1,1024,16,8,64,tree \
    --shape 32,1024,16,8,64,tree --out "$out/planes-kernel.json" > "$out/planes-kernel.log" 2>&1
  summary+=("kernel shapes rc=$?")
  grep -E '^B=' "$out/planes-kernel.log"
fi
if want cudashm && [ -x "$bundle/bin/mlaverify-server" ]; then
  # CUDA shared memory: the checked demo with every Verify tensor in a
  # client device buffer (unary, stream), then one call in flight at L=16K,
  # 64 workers at L=1K and 4 workers x 32 items at L=1K, over VerifyStream,
  # each with its floor. Rows named like the planes' for service_planes.py.
  # CUDASHM_HEADS="8 16" adds a server with 16 heads whose rows are named
  # with an -h16 suffix (the demos run on the first server only).
  for heads in ${CUDASHM_HEADS:-8}; do
    sfx=""; [ "$heads" = 8 ] || sfx="-h$heads"
    start_server "cudashm$sfx" 127.0.0.1:0 --devices 0 --heads "$heads" --pool-bytes 40GiB \
      --allow-client-shm true
    if [ -z "$sfx" ]; then
      timeout 90 "${cl[@]}" demo --sequences 4 --prompt-len 2000 --steps 2 --drafts 16 \
        --data-plane cuda-shm > "$out/demo-cuda-shm-unary.log" 2>&1
      summary+=("demo cuda-shm unary rc=$?"); tail -1 "$out/demo-cuda-shm-unary.log"
      timeout 60 "${cl[@]}" demo --sequences 2 --prompt-len 500 --steps 1 --drafts 16 \
        --data-plane cuda-shm --stream > "$out/demo-cuda-shm-stream.log" 2>&1
      summary+=("demo cuda-shm stream rc=$?"); tail -1 "$out/demo-cuda-shm-stream.log"
    fi
    for row in "c1-16k:--concurrency 1 --duration-s 5 --warmup-s 1 --prompt-len 16384 --max-seq-len 16900" \
               "c64-1k:--concurrency 64 --duration-s 6 --warmup-s 1.5 --prompt-len 1024" \
               "c4-1k-items32:--concurrency 4 --items 32 --duration-s 6 --warmup-s 1.5 --prompt-len 1024"; do
      name=${row%%:*}$sfx
      # shellcheck disable=SC2086  # the row's flags are several words
      timeout 90 "${cl[@]}" load --drafts 16 --floor --progress false --stream --data-plane cuda-shm \
        ${row#*:} --json "$out/planes-cuda-shm-stream-$name.json" \
        > "$out/planes-cuda-shm-stream-$name.log" 2>&1
      summary+=("load cuda-shm stream $name rc=$?")
      echo "== cuda-shm stream $name"
      grep -E "^(verify calls|latency|server split|floor: |errors|result)" \
        "$out/planes-cuda-shm-stream-$name.log"
    done
    grep -E "CUDA shared|error|warn" "$out/server-cudashm$sfx.log" | head -5
    stop_server "cudashm$sfx"
  done
fi
# The per-layer Verify latency rows of pyclient and pynative: one call in
# flight, L=16K, N=16, on the server of start_server, into BASE.json/.log.
#   latency_cpp BASE PLANE MODE SECONDS: the C++ client (mlaverify-client load)
#   latency_py BASE PLANE MODE SECONDS [--native]: the Python client ($pypath)
latency_cpp() {
  local base=$1 plane=$2 mode=$3 seconds=$4 stream=()
  [ "$mode" = stream ] && stream=(--stream)
  timeout 60 "${cl[@]}" load --concurrency 1 --duration-s "$seconds" --warmup-s 1 \
    --prompt-len 16384 --max-seq-len 16900 --drafts 16 --progress false "${stream[@]}" \
    --data-plane "$plane" --json "$base.json" > "$base.log" 2>&1
}
latency_py() {
  local base=$1 plane=$2 mode=$3 seconds=$4 stream=()
  shift 4
  [ "$mode" = stream ] && stream=(--stream)
  PYTHONPATH=$pypath timeout 90 python3 bench/python_client_latency.py "$@" \
    --target "127.0.0.1:$gport" --plane "$plane" --prompt-len 16384 --drafts 16 "${stream[@]}" \
    --duration-s "$seconds" --warmup-s 1 --json "$base.json" > "$base.log" 2>&1
}
if want pyclient && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The Python client on the GPU: its CUDA shared-memory tests against the
  # CUDA server (client/python/tests/test_cuda_shm.py, torch CUDA tensors),
  # then its per-layer Verify latency next to the C++ client's in the same
  # call, on one server: L=16K, N=16, one call in flight (over a VerifyStream,
  # and unary for CUDA shm), per plane: the C++ client, the pure-Python path
  # and (shared-memory planes) the native path, alternating.
  pypath=${PYPKG:-$bundle/python}
  tests/python_cuda_shm_gpu.sh "$pypath" "$bundle/bin/mlaverify-server" client/python \
    > "$out/pyclient-tests.log" 2>&1
  summary+=("python cuda-shm tests rc=$?"); tail -4 "$out/pyclient-tests.log"
  start_server pyclient 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 40GiB --allow-client-shm true
  # PYCLIENT_ROWS picks rows (plane:mode), e.g. "cuda-shm:stream cuda-shm:unary".
  read -r -a pyrows <<< "${PYCLIENT_ROWS:-cuda-shm:stream cuda-shm:unary shm:stream inline:stream}"
  for row in "${pyrows[@]}"; do
    plane=${row%%:*} mode=${row#*:}
    latency_cpp "$out/pyclient-cpp-$plane-$mode" "$plane" "$mode" 5
    summary+=("load c++ $row rc=$?")
    latency_py "$out/pyclient-py-$plane-$mode" "$plane" "$mode" 5
    summary+=("latency python $row rc=$?")
    if [ "$plane" != inline ]; then
      # The native path (mlaverify.native: the C++ client by ctypes; its
      # library, mlaverify/lib/libmlaverify_native.so in the package folder,
      # loads its gRPC, protobuf and Abseil from the bundle's lib/).
      latency_py "$out/pyclient-native-$plane-$mode" "$plane" "$mode" 5 --native
      summary+=("latency native python $row rc=$?")
    fi
    python3 bench/pyclient_rows.py "$row" "$out/pyclient-cpp-$plane-$mode.json" \
      "$out/pyclient-py-$plane-$mode.json" "$out/pyclient-native-$plane-$mode.json"
  done
  # Each part of one Python call alone, over a CUDA region (bench/python_client_parts.py).
  PYTHONPATH=$pypath timeout 60 python3 bench/python_client_parts.py --target "127.0.0.1:$gport" \
    --plane cuda-shm --drafts 16 --calls 1000 > "$out/pyclient-parts-cuda-shm.log" 2>&1
  summary+=("python parts cuda-shm rc=$?"); cat "$out/pyclient-parts-cuda-shm.log"
  stop_server pyclient
fi
if want pynative && [ -x "$bundle/bin/mlaverify-server" ]; then
  # The native Python path against the C++ client, paired in rounds: per row
  # (plane:mode), PYNATIVE_ROUNDS (5) rounds of the C++ client then each
  # native variant, 3 s each, L=16K, N=16, one call in flight;
  # bench/pyclient_rounds.py prints, per variant, each round's difference
  # from the C++ client and their median (the rows of pyclient compare one
  # run of each, minutes apart). Variants (PYNATIVE_VARIANTS): call
  # (stream.verify(layer, items)), bind (a step's item bound once,
  # BoundVerify.verify(layer)), bind-nowait (bound with
  # wait_for_stream=False: no wait for the current CUDA stream per call, as
  # the C++ client's load makes none). A run takes ~20 s with its ramp-up
  # (a 16K prompt over 61 layers): rounds x (1 + variants) x 20 s per row,
  # about 5 minutes with the defaults (one row: cuda-shm:stream).
  pypath=${PYPKG:-$bundle/python}
  start_server pynative 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 40GiB --allow-client-shm true
  read -r -a pnrows <<< "${PYNATIVE_ROWS:-cuda-shm:stream}"
  read -r -a pnvariants <<< "${PYNATIVE_VARIANTS:-call bind bind-nowait}"
  for row in "${pnrows[@]}"; do
    plane=${row%%:*} mode=${row#*:}
    for r in $(seq 1 "${PYNATIVE_ROUNDS:-5}"); do
      base="$out/pynative-$plane-$mode-r$r"
      latency_cpp "$base-cpp" "$plane" "$mode" 3
      for v in "${pnvariants[@]}"; do
        case $v in
          call) vflags=(--native) ;;
          bind) vflags=(--native --bind) ;;
          bind-nowait) vflags=(--native --bind --no-stream-wait) ;;
          *) echo "PYNATIVE_VARIANTS: unknown variant $v (call, bind, bind-nowait)" >&2; exit 2 ;;
        esac
        latency_py "$base-native-$v" "$plane" "$mode" 3 "${vflags[@]}"
      done
    done
    for v in "${pnvariants[@]}"; do
      pairs=()
      for r in $(seq 1 "${PYNATIVE_ROUNDS:-5}"); do
        pairs+=("$out/pynative-$plane-$mode-r$r-cpp.json" "$out/pynative-$plane-$mode-r$r-native-$v.json")
      done
      python3 bench/pyclient_rounds.py "$row $v" "${pairs[@]}" | tee "$out/pynative-$plane-$mode-$v.txt"
      summary+=("pynative $row $v: $(grep -c 'round' "$out/pynative-$plane-$mode-$v.txt") rounds")
    done
  done
  stop_server pynative
fi
if want latency && [ -x "$bundle/bin/mlaverify-server" ]; then
  # One call in flight over shm streams at L=16K (the planes' lowest-latency
  # row) with the server's defaults and with eager launches instead of graph
  # replays.
  for variant in defaults eager; do
    case $variant in
      defaults) vflags=() ;;
      eager) vflags=(--cuda-graphs false) ;;
    esac
    start_server "latency-$variant" 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 8GiB \
      --allow-client-shm true "${vflags[@]}"
    timeout 60 "${cl[@]}" load --concurrency 1 --duration-s 5 --warmup-s 1 --prompt-len 16384 \
      --max-seq-len 16900 --drafts 16 --stream --data-plane shm --shm-staging-mib 1200 \
      --json "$out/latency-shm-stream-c1-16k-$variant.json" \
      > "$out/latency-shm-stream-c1-16k-$variant.log" 2>&1
    summary+=("latency $variant rc=$?")
    echo "== $variant"
    grep -E "^(verify calls|latency|server split|result)" "$out/latency-shm-stream-c1-16k-$variant.log"
    stop_server "latency-$variant"
  done
fi
if want steps && [ -x "$bundle/bin/mlaverify-server" ]; then
  # Device-driven steps (docs/steps.md): the GPU step tests, the doorbell
  # probe's floor, the kernel for the same shapes, then the service: each
  # row of `load --steps` (61 layers, N=16 trees) beside today's per-layer
  # VerifyStream over CUDA shm in the same server, TP over device 0 twice
  # against one device at 16 heads, and a scheduler killed mid-step.
  # Summarised by bench/steps_report.py into steps.json. STEPS_SECS: the
  # measured seconds of each load row (5).
  secs=${STEPS_SECS:-5}
  if [ -x "$bundle/bin/gpu_steps_test" ]; then
    timeout 150 "$bundle/bin/gpu_steps_test" > "$out/gpu_steps_test.log" 2>&1
    summary+=("gpu steps test rc=$?")
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|rel_err' "$out/gpu_steps_test.log" | head -20
  fi
  for work in "0 0" "50 0" "0 30" "50 30"; do
    read -r cw sw <<< "$work"
    timeout 60 "$bundle/bin/mlaverify-doorbell-probe" --layers 61 --rounds 50 \
      --client-work-us "$cw" --server-work-us "$sw" --json "$out/probe-c${cw}-s${sw}.json" \
      2>&1 | tee -a "$out/probe.log"
    summary+=("probe client ${cw} server ${sw} rc=${PIPESTATUS[0]}")
  done
  timeout 120 "$bundle/bin/mlaverify-bench" --shape 1,16384,16,8 --shape 32,1024,16,8 \
    --shape 1,16384,16,16 --shape 1,4096,16,8 --out "$out/steps-kernel.json" > "$out/steps-kernel.log" 2>&1
  summary+=("steps kernel rc=$?")
  grep -E '^B=' "$out/steps-kernel.log"
  # step_row ROW ARGS...: one `load --steps` against the running server, one
  # scheduler (a step's own latency; ARGS may raise --concurrency).
  step_row() {
    local row=$1 one=(--concurrency 1)
    shift
    [[ " $* " == *" --concurrency "* ]] && one=()
    timeout 120 "${cl[@]}" load --steps --drafts 16 --progress false --duration-s "$secs" \
      --warmup-s 1 "${one[@]}" "$@" --json "$out/steps-$row.json" > "$out/steps-$row.log" 2>&1
    summary+=("steps $row rc=$?")
    echo "== $row"
    grep -E "^(steps|step|layer|layers|open|commits|errors|first error):|PASS|FAIL" "$out/steps-$row.log"
  }
  start_server steps 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 16GiB --allow-client-shm true \
    --step-lanes 4
  step_row gpu-1x16k --doorbell gpu --prompt-len 16384 --max-seq-len 16900 --shm-staging-mib 1200
  step_row gpu-1x16k-work50 --doorbell gpu --prompt-len 16384 --max-seq-len 16900 \
    --shm-staging-mib 1200 --client-work-us 50
  step_row gpu-32x1k --doorbell gpu --items 32 --prompt-len 1024 --max-seq-len 1600
  # Four schedulers, one per lane: steps side by side.
  step_row gpu-1x4k-c4 --doorbell gpu --prompt-len 4096 --max-seq-len 4700 --concurrency 4
  step_row host-1x16k --doorbell host --prompt-len 16384 --max-seq-len 16900 --shm-staging-mib 1200
  # Today's path in the same server: per-layer VerifyStream over CUDA shm.
  timeout 60 "${cl[@]}" load --concurrency 1 --duration-s "$secs" --warmup-s 1 --prompt-len 16384 \
    --max-seq-len 16900 --drafts 16 --stream --data-plane cuda-shm --progress false \
    --json "$out/steps-verify-1x16k.json" > "$out/steps-verify-1x16k.log" 2>&1
  summary+=("verify 1x16k rc=$?")
  grep -E "^(latency|server split|result)" "$out/steps-verify-1x16k.log"
  stop_server steps
  # TP at equal work: 16 heads on device 0 once, then split over 0 listed twice.
  start_server steps-h16 127.0.0.1:0 --devices 0 --heads 16 --pool-bytes 16GiB \
    --allow-client-shm true
  step_row gpu-1x16k-h16 --doorbell gpu --prompt-len 16384 --max-seq-len 16900 --shm-staging-mib 1200
  stop_server steps-h16
  start_server steps-tp 127.0.0.1:0 --devices 0,0 --parallel-mode tp --heads 16 --pool-bytes 8GiB \
    --allow-client-shm true
  step_row gpu-1x16k-tp00 --doorbell gpu --prompt-len 16384 --max-seq-len 16900 --shm-staging-mib 1200
  stop_server steps-tp
  # A scheduler killed mid-step (SIGKILL): its step aborts at the layer
  # timeout, its sequences expire, every page is back, the next steps run.
  start_server steps-kill 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 4GiB --allow-client-shm true \
    --step-layer-timeout-ms 200 --idle-timeout-s 2
  "${cl[@]}" load --steps --doorbell gpu --drafts 16 --prompt-len 4096 --max-seq-len 4700 \
    --duration-s 30 --progress false > "$out/steps-kill-victim.log" 2>&1 &
  victim=$!
  # Killed once its steps run (its prompts take a while to append).
  for _ in $(seq 60); do
    curl -s "http://127.0.0.1:$aport/metrics" | grep -qE '^mlaverify_device_steps_opened_total [1-9]' && break
    sleep 0.5
  done
  sleep 1
  kill -KILL "$victim"; wait "$victim" 2>/dev/null
  sleep 4  # the layer timeout, then the idle expiry
  curl -s "http://127.0.0.1:$aport/metrics" | grep -E '^mlaverify_(device_steps|kv_pages_(free|capacity)|sequences_live)' \
    | tee "$out/steps-kill-metrics.txt"
  step_row kill-after --doorbell gpu --prompt-len 4096 --max-seq-len 4700
  stop_server steps-kill
  python3 bench/steps_report.py "$out" > "$out/steps.json" 2> "$out/steps-report.log"
  summary+=("steps report rc=$?")
  tail -20 "$out/steps-report.log"
fi
if want fault && [ -x "$bundle/bin/mlaverify-server" ]; then
  # A real device fault: the third verify launch runs a trapping kernel. The
  # demo must fail with INTERNAL naming the device, health must go
  # NOT_SERVING, the server must keep answering and exit cleanly.
  start_server fault 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 4GiB --testing-fault-after-launches 3
  timeout 60 "${cl[@]}" demo --sequences 1 --prompt-len 100 --steps 1 --drafts 4 > "$out/demo-fault.log" 2>&1
  echo "fault demo rc=$? (expected non-zero)"; grep -m2 -E "INTERNAL|faulted" "$out/demo-fault.log"
  "${cl[@]}" health > "$out/health-fault.txt" 2>&1; echo "health after fault: $(cat "$out/health-fault.txt")"
  curl -s -o /dev/null -w "readyz after fault: %{http_code}\n" "http://127.0.0.1:$aport/readyz"
  grep -m3 -E "faulted|NOT_SERVING" "$out/server-fault.log"
  stop_server fault
fi
if want engine && [ -x "$bundle/bin/mlaverify-engine-bench" ]; then
  # The engine in process: one item in flight and 64 threads, L=1K and 16K,
  # single device; then TP and DP over device 0 listed twice at L=1K.
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  timeout 240 "$bundle/bin/mlaverify-engine-bench" --devices 0 --prefix-len 1024,16384 --threads 1,64 \
    --duration-s 5 --pool-bytes 80GiB --gpu-name "$gpu" --json "$out/engine.json" 2>&1 | tee "$out/engine.log"
  summary+=("engine bench single rc=${PIPESTATUS[0]}")
  for mode in tp dp; do
    timeout 120 "$bundle/bin/mlaverify-engine-bench" --devices 0,0 --mode $mode --prefix-len 1024 \
      --threads 1,64 --duration-s 4 --pool-bytes 20GiB --gpu-name "$gpu" --json "$out/engine.json" 2>&1 |
      tee -a "$out/engine.log"
    summary+=("engine bench $mode rc=${PIPESTATUS[0]}")
  done
fi
if want completion && [ -x "$bundle/bin/mlaverify-engine-bench" ]; then
  # Who completes a finished batch, side by side in one run: the device
  # thread itself (--completion-thread false) or the completion thread it
  # hands batches to; each also with the device thread sleeping instead of
  # polling (--poll-launches false). The engine in process at L=1K, one and 64 threads,
  # host and device inputs on the GPU; then the same with the fake backend
  # (a device that takes 40 us + 1 us per request and computes nothing: the
  # host side alone, on this machine's cores).
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  for ct in false true; do
    for inputs in host device; do
      timeout 100 "$bundle/bin/mlaverify-engine-bench" --devices 0 --prefix-len 1024 --threads 1,64 \
        --duration-s 4 --warmup-s 1 --pool-bytes 40GiB --inputs $inputs --completion-thread $ct \
        --gpu-name "$gpu" --json "$out/completion.json" 2>&1 | tee -a "$out/completion.log"
      summary+=("completion gpu ct=$ct inputs=$inputs rc=${PIPESTATUS[0]}")
    done
    # The device thread sleeping in a blocking-sync wait instead of polling
    # (--poll-launches false; bench/NOTES.md, "A device thread that sleeps").
    timeout 100 "$bundle/bin/mlaverify-engine-bench" --devices 0 --prefix-len 1024 --threads 1,64 \
      --duration-s 4 --warmup-s 1 --pool-bytes 40GiB --inputs device --completion-thread $ct \
      --poll-launches false --gpu-name "$gpu" --json "$out/completion.json" 2>&1 |
      tee -a "$out/completion.log"
    summary+=("completion gpu ct=$ct no polling rc=${PIPESTATUS[0]}")
    timeout 100 "$bundle/bin/mlaverify-engine-bench" --backend fake --devices 0 --prefix-len 1024 \
      --threads 1,16,64 --duration-s 4 --warmup-s 1 --pool-bytes 6GiB --completion-thread $ct \
      --json "$out/completion-fake.json" 2>&1 | tee -a "$out/completion.log"
    summary+=("completion fake ct=$ct rc=${PIPESTATUS[0]}")
  done
fi
if want soak && [ -x "$bundle/bin/mlaverify-server" ]; then
  # scripts/soak.sh on the GPU: the demo geometry, 64 workers, SOAK_S
  # measured seconds (default 300) after a 30-s warm-up.
  timeout 560 scripts/soak.sh --bin-dir "$bundle/bin" --duration-s "${SOAK_S:-300}" --warmup-s 30 \
    --workers 64 --out "$out/soak" \
    --server-flags "--layers 61 --heads 8 --page-size 64 --pool-bytes 4GiB --max-message-bytes 8MiB" \
    > "$out/soak.log" 2>&1
  summary+=("soak rc=$?")
  grep -E "^(result|server|soak)|verify calls|pages" "$out/soak.log" | tail -12
fi
if want anchor; then
  timeout 450 "$bundle/bin/mlaverify-bench" --suite anchor --out "$out/anchor.json" 2>&1 |
    tee "$out/anchor.log"
  summary+=("anchor rc=${PIPESTATUS[0]}")
fi
if want fp8 && [ -x "$bundle/bin/mlaverify-server" ]; then
  # fp8 latent KV on the GPU, within about five minutes (each step's timeout
  # caps it): the GPU tests' fp8 cases (the attention over fp8 pools: the
  # kernel grid, both plans, graph replay; the quantizing draft write and row
  # copy against the CPU's bytes, the compaction of 656-byte rows; CUDA
  # engines over fp8 pools against the CPU backend), the kernel at the anchor
  # shapes (page 64, tree) in bf16 and fp8 side by side, the two memory-bound
  # anchors again on N(0,1) and heavy-tailed rows (fp8 rows carry their error
  # against the bf16 pool), AppendKv's row copy into both pools, and a CUDA
  # server with --kv-dtype fp8: its info (pages, bytes per row) and the
  # checked demo over every data plane, unary and stream.
  timeout 150 "$bundle/bin/gpu_kernels_test" --gtest_filter='*Fp8*:*DraftWrite*:*Compaction*' \
    > "$out/fp8_gpu_kernels_test.log" 2>&1
  summary+=("fp8 gpu kernel tests rc=$?")
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|rel_err' "$out/fp8_gpu_kernels_test.log" | head -20
  timeout 60 "$bundle/bin/gpu_engine_test" --gtest_filter='*Fp8*:*fp8*' \
    > "$out/fp8_gpu_engine_test.log" 2>&1
  summary+=("fp8 gpu engine tests rc=$?")
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure' "$out/fp8_gpu_engine_test.log" | head -20
  timeout 75 "$bundle/bin/mlaverify-bench" --suite anchor64 --kv-dtype both --reps 30 \
    --out "$out/fp8_anchor.json" 2>&1 | tee "$out/fp8_anchor.log"
  summary+=("fp8 anchor rc=${PIPESTATUS[0]}")
  for values in normal heavy; do
    timeout 40 "$bundle/bin/mlaverify-bench" --shape 32,65536,4,8,64 --shape 8,65536,4,16,64 \
      --kv-dtype both --kv-values $values --reps 20 --check-rows 128 \
      --out "$out/fp8_$values.json" 2>&1 | tee "$out/fp8_$values.log"
    summary+=("fp8 $values rows rc=${PIPESTATUS[0]}")
  done
  timeout 30 "$bundle/bin/mlaverify-bench" --append-rate --reps 20 --out "$out/fp8_append.json" 2>&1 |
    tee "$out/fp8_append.log"
  summary+=("fp8 append rc=${PIPESTATUS[0]}")
  start_server fp8 127.0.0.1:0 --devices 0 --heads 8 --pool-bytes 8GiB --kv-dtype fp8 \
    --allow-client-shm true
  grep -iE "dtype|pages|bytes" "$out/info-fp8.txt" | head -6
  for plane in inline shm cuda-shm; do
    for rpc in unary stream; do
      extra=(); [ "$rpc" = stream ] && extra=(--stream)
      timeout 30 "${cl[@]}" demo --sequences 3 --prompt-len 700 --steps 2 --drafts 16 \
        --data-plane $plane "${extra[@]}" > "$out/fp8-demo-$plane-$rpc.log" 2>&1
      summary+=("fp8 demo $plane $rpc rc=$?")
      echo "fp8 demo $plane $rpc: $(tail -1 "$out/fp8-demo-$plane-$rpc.log")"
    done
  done
  stop_server fp8
  grep -E "captured|engine:|fault|rror" "$out/server-fp8.log" | head -4
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
if want small; then
  # Small batch, default kernel: the split knobs --ctas-per-sm and --min-chunk-tiles at B=1.
  for flags in "" "--ctas-per-sm 2 --min-chunk-tiles 4" "--min-chunk-tiles 4" "--min-chunk-tiles 1" "--pdl"; do
    echo "== flags: ${flags:-default}"
    # shellcheck disable=SC2086  # $flags holds several words
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
    # shellcheck disable=SC2086  # $flags holds several words
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
    "$bundle/bin/mlaverify-bench" --shape "${TIMELINE_SHAPE:-1,4096,16,8}" --reps 3 \
    > "$out/ncu_small_nocache.txt" 2>&1
  grep -E 'Kernel|gpu__time_duration' "$out/ncu_small_nocache.txt" | head -24
fi
if want stalls && command -v ncu >/dev/null; then
  # Where the attention kernel's warps wait: warp-state statistics and
  # per-SASS-instruction stall samples (source page as CSV) at one shape.
  shape=${STALL_SHAPE:-8,16384,16,8}
  # STALL_ARGS: more bench flags, e.g. "--kv-dtype fp8".
  read -r -a stall_args <<< "${STALL_ARGS:-}"
  # STALL_SAMPLING=0 samples every 32 cycles (small launches need it).
  sampling=()
  [ -n "${STALL_SAMPLING:-}" ] && sampling=(--warp-sampling-interval "$STALL_SAMPLING")
  timeout 300 ncu --clock-control none --section WarpStateStats --section SourceCounters "${sampling[@]}" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --import-source no -k regex:Attention --launch-skip 2 --launch-count 1 -o "$out/stalls" \
    "$bundle/bin/mlaverify-bench" --shape "$shape" --reps 3 "${stall_args[@]}" \
    > "$out/stalls_run.txt" 2>&1
  ncu -i "$out/stalls.ncu-rep" --print-details all > "$out/stalls_details.txt" 2>&1
  ncu -i "$out/stalls.ncu-rep" --page source --csv --print-source sass > "$out/stalls_sass.csv" 2>&1
  grep -E 'Throughput|Pipe|Stall|stall|Issue|Warp Cycles|Eligible|Active|Duration' \
    "$out/stalls_details.txt" | head -40
  wc -l "$out/stalls_sass.csv"; head -3 "$out/stalls_sass.csv" | cut -c1-600
  python3 bench/research/sass_profile.py "$out/stalls_sass.csv" --regions 0x1000 > "$out/stalls_regions.txt" 2>&1
  python3 bench/research/sass_profile.py "$out/stalls_sass.csv" --loops > "$out/stalls_loops.txt" 2>&1
  grep -E "^== |stalls:" "$out/stalls_loops.txt"
  tail -12 "$out/stalls_regions.txt"
fi
if want sass && command -v cuobjdump >/dev/null; then
  # The attention kernel instances' SASS (instruction counts per loop, scheduling).
  cuobjdump -sass -arch sm_90 "$bundle/bin/mlaverify-bench" > "$out/sass_sm90.txt" 2>&1
  summary+=("sass rc=$? ($(wc -l < "$out/sass_sm90.txt") lines)")
  # Instructions and WARPSYNC per tile loop of every attention kernel: compare
  # with the previous build's before reading an A/B (bench/NOTES.md, "Reading an A/B").
  python3 bench/research/sass_loops.py "$out/sass_sm90.txt" > "$out/sass_loops.txt" 2>&1
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
