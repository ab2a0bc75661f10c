#!/usr/bin/env bash
# Installs the Python package as a user would, from the files a fresh clone
# has, into a fresh venv in a temporary folder, and runs its tests from
# there against the built server:
#   python_package_test.sh PYTHON SOURCE_DIR SERVER_BINARY
# The install is offline, from Debian's packages only (README.md,
# "Python client"):
#   python3 -m venv --system-site-packages V
#   V/bin/pip install --no-build-isolation --no-index ./client/python
# Exit 77 (skipped) when PYTHON lacks venv, pip, setuptools, wheel, grpc,
# protobuf, numpy or pytest, or protoc/grpc_python_plugin are missing.
set -euo pipefail
python=$1
source=$(realpath "$2") server=$(realpath "$3")
if ! "$python" -c "import ensurepip, setuptools, wheel, grpc, google.protobuf, numpy, pytest" \
    2>/dev/null || ! command -v protoc >/dev/null || ! command -v grpc_python_plugin >/dev/null; then
  echo "SKIPPED: needs python3-venv python3-pip python3-setuptools python3-wheel python3-grpcio" \
       "python3-protobuf python3-numpy python3-pytest protobuf-compiler protobuf-compiler-grpc" \
       "(scripts/install_deps.sh)"
  exit 77
fi
tmp=$(mktemp -d /tmp/mlaverify-pkg.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
# What a clone holds (tracked files and new ones not ignored; no build
# output, no generated stubs), of the paths the package build reads.
paths=(client/python proto CMakeLists.txt README.md)
if git -C "$source" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # (A tracked file deleted in the work tree is left out, as a commit would.)
  git -C "$source" ls-files -z -co --exclude-standard -- "${paths[@]}" |
    while IFS= read -r -d '' f; do [ -e "$source/$f" ] && printf '%s\0' "$f"; done |
    (cd "$source" && tar --null -T - -cf -) | tar -C "$tmp/src" -xf -
else
  (cd "$source" && tar -cf - --exclude=build --exclude='*.egg-info' --exclude=__pycache__ \
    "${paths[@]}") | tar -C "$tmp/src" -xf -
fi
if [ -e "$tmp/src/client/python/mlaverify/v1" ]; then
  echo "FAIL: generated stubs are part of the source files" >&2
  exit 1
fi
"$python" -m venv --system-site-packages "$tmp/V"
if ! "$tmp/V/bin/pip" install --no-build-isolation --no-index --no-cache-dir \
    "$tmp/src/client/python" > "$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log"
  exit 1
fi
grep -E "^Successfully installed" "$tmp/pip.log"
export PYTHONPATH=$tmp/src/client/python/tests PYTHONDONTWRITEBYTECODE=1 MLAVERIFY_SERVER=$server
export MLAVERIFY_EXPECT_INSTALLED=1
# Not from the source folder: the installed package is the one imported.
cd "$tmp"
"$tmp/V/bin/python" -m pytest -q -p no:cacheprovider -rs "$tmp/src/client/python/tests"
