#!/usr/bin/env bash
# Configures and builds into a build folder. Used by test.sh and demo.sh.
#   scripts/build.sh            build/: g++, the CUDA kernels too when nvcc is found
#                               (/usr/local/cuda or PATH), RelWithDebInfo
#   scripts/build.sh sanitize   build-sanitize/: clang with -Werror=thread-safety
#                               (the ABSL_GUARDED_BY annotations are checked) and
#                               AddressSanitizer + UndefinedBehaviorSanitizer, CPU
#                               only, with the libFuzzer targets (tests/fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
flavor=${1:-default}
case $flavor in
  default)
    dir=build
    args=(-DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}")
    ;;
  sanitize)
    dir=build-sanitize
    san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
          -DMLAVERIFY_WITH_CUDA=OFF -DMLAVERIFY_FUZZ=ON
          "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror=thread-safety $san"
          "-DCMAKE_EXE_LINKER_FLAGS=$san" "-DCMAKE_SHARED_LINKER_FLAGS=$san")
    ;;
  *)
    echo "usage: $0 [default|sanitize]" >&2
    exit 2
    ;;
esac
if ! cmake -S . -B "$dir" -G Ninja "${args[@]}" > "$dir-configure.log" 2>&1; then
  cat "$dir-configure.log" >&2
  exit 1
fi
grep -E "nvcc not found|The CUDA compiler identification" "$dir-configure.log" || true
# ptxas -v prints registers/spills per kernel on every CUDA compile; keep the
# build log readable (kernels/testing/ptxas_budget.py checks them).
cmake --build "$dir" -j"$(nproc)" 2>&1 | { grep -vE '^(ptxas info|    [0-9]+ bytes stack)' || true; }
