#!/usr/bin/env bash
# The Python client's CUDA shared-memory tests on a GPU machine, against a
# server built with CUDA:
#   tests/python_cuda_shm_gpu.sh PACKAGE_DIR SERVER_BINARY CLIENT_PYTHON_SOURCE
# PACKAGE_DIR holds mlaverify/ with its generated stubs (build/client/python,
# or a site-packages the package was installed into). Needs python3 with
# torch (CUDA), grpcio, protobuf, numpy and pytest. Exit 77 (skipped) when
# torch sees no CUDA device.
set -euo pipefail
package_dir=$(realpath "$1") server=$(realpath "$2") source=$(realpath "$3")
python=${PYTHON:-python3}
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "SKIPPED: $python has no torch"
  exit 77
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "SKIPPED: torch sees no CUDA device"
  exit 77
fi
export PYTHONPATH=$package_dir:$source/tests PYTHONDONTWRITEBYTECODE=1 MLAVERIFY_SERVER=$server
export MLAVERIFY_CUDA_TESTS=1
cd "$package_dir"
# -rA: every test's outcome by name, so a skip cannot pass for a pass.
exec "$python" -m pytest -q -p no:cacheprovider -rA "$source/tests/test_cuda_shm.py"
