#!/usr/bin/env bash
# Configures and builds everything into build/ (the CUDA kernels too when
# nvcc is found at /usr/local/cuda or on PATH). Used by test.sh and demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
build_type=${BUILD_TYPE:-RelWithDebInfo}
if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" > build-configure.log 2>&1; then
  cat build-configure.log >&2
  exit 1
fi
grep -E "nvcc not found|The CUDA compiler identification" build-configure.log || true
# ptxas -v prints registers/spills per kernel on every CUDA compile; keep the
# build log readable (the numbers are in bench/NOTES.md).
cmake --build build -j"$(nproc)" 2>&1 | { grep -vE '^(ptxas info|    [0-9]+ bytes stack)' || true; }
