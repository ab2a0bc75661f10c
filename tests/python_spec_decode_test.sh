#!/usr/bin/env bash
# Speculative decoding through a CPU server against plain greedy decoding
# (client/python/examples/test_spec_decode.py, which starts the server):
#   python_spec_decode_test.sh PYTHON PACKAGE_DIR SERVER_BINARY CLIENT_PYTHON_SOURCE
# Exit 77 (skipped) when PYTHON lacks grpc, numpy, pytest, protobuf or torch.
set -euo pipefail
python=$1
package_dir=$(realpath "$2") server=$(realpath "$3") source=$(realpath "$4")
if ! "$python" -c "import grpc, numpy, pytest, google.protobuf, torch" 2>/dev/null; then
  echo "SKIPPED: $python lacks grpc, numpy, pytest, protobuf or torch (scripts/install_deps.sh installs python3-grpcio python3-numpy python3-pytest python3-protobuf python3-torch)"
  exit 77
fi
# One torch thread: the machine's cores go to the server and the other tests.
export PYTHONPATH=$package_dir PYTHONDONTWRITEBYTECODE=1 MLAVERIFY_SERVER=$server OMP_NUM_THREADS=1
# Not from the source folder: its mlaverify/ has no generated stubs.
cd "$package_dir"
exec "$python" -m pytest -q -p no:cacheprovider -rs "$source/examples/test_spec_decode.py"
