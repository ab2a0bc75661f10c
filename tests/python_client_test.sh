#!/usr/bin/env bash
# Runs client/python's pytest suite against the built server:
#   python_client_test.sh PYTHON PACKAGE_DIR SERVER_BINARY CLIENT_PYTHON_SOURCE
# Exit 77 (skipped) when PYTHON lacks grpc, numpy or pytest.
set -euo pipefail
python=$1
package_dir=$(realpath "$2") server=$(realpath "$3") source=$(realpath "$4")
if ! "$python" -c "import grpc, numpy, pytest, google.protobuf" 2>/dev/null; then
  echo "SKIPPED: $python lacks grpc, numpy, pytest or protobuf (scripts/install_deps.sh installs python3-grpcio python3-numpy python3-pytest python3-protobuf)"
  exit 77
fi
export PYTHONPATH=$package_dir:$source/tests PYTHONDONTWRITEBYTECODE=1 MLAVERIFY_SERVER=$server
# Not from the source folder: its mlaverify/ has no generated stubs.
cd "$package_dir"
# tests/test_example.py runs examples/verify_layers.py as a user would.
exec "$python" -m pytest -q -p no:cacheprovider -rs "$source/tests"
