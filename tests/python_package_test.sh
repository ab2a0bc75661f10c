#!/usr/bin/env bash
# Installs the Python package as a user would, from the files a fresh clone
# has, into a fresh venv in a temporary folder, and runs its tests from
# there against the built server:
#   python_package_test.sh PYTHON SOURCE_DIR SERVER_BINARY [NATIVE_LIBRARY]
# The install is offline, from Debian's packages only (client/python/README.md,
# "Installing"):
#   python3 -m venv --system-site-packages V
#   V/bin/pip install --no-build-isolation --no-index ./client/python
# Then the other ways the package is shipped: the sdist, unpacked away from
# the checkout, must build a wheel that installs with the same version; and
# with NATIVE_LIBRARY (the libmlaverify_native.so the build made) a wheel
# built with MLAVERIFY_NATIVE_LIB_PATH must carry it, be tagged for the
# platform, and load it where it is installed (its native tests run there).
# Exit 77 (skipped) when PYTHON lacks venv, pip, setuptools, wheel, grpc,
# protobuf, numpy or pytest, or protoc/grpc_python_plugin are missing.
set -euo pipefail
python=$1
source=$(realpath "$2") server=$(realpath "$3") native_lib=${4:+$(realpath "$4")}
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
# The wheels below must find their library by themselves.
unset MLAVERIFY_NATIVE_LIB MLAVERIFY_NATIVE_LIB_PATH
# Not from the source folder: the installed package is the one imported.
cd "$tmp"
"$tmp/V/bin/python" -m pytest -q -p no:cacheprovider -rs "$tmp/src/client/python/tests"
version=$("$tmp/V/bin/python" -c "import mlaverify; print(mlaverify.__version__)")

# Runs "$@" with its output in $tmp/log; on failure shows it and fails.
quiet() {
  if ! "$@" > "$tmp/log" 2>&1; then
    cat "$tmp/log" >&2
    echo "FAIL: $*" >&2
    exit 1
  fi
}
# The names in wheel $1, one a line.
wheel_files() {
  "$python" -c "import sys, zipfile; print(*zipfile.ZipFile(sys.argv[1]).namelist(), sep='\n')" "$1"
}
# A fresh venv $1 with wheel $2 installed (its dependencies: Debian's).
install_wheel() {
  "$python" -m venv --system-site-packages "$1"
  quiet "$1/bin/pip" install --no-index --no-cache-dir "$2"
}
# Prints the one file matching glob $1 (FAIL when not exactly one).
only() {
  if [ $# -ne 1 ] || [ ! -e "$1" ]; then
    echo "FAIL: expected one file, got: $*" >&2
    exit 1
  fi
  echo "$1"
}

# The sdist: made from the clone's files, unpacked where no checkout is
# above it (the build must take the .proto and the version from the sdist
# itself), built into a pure wheel, installed in a fresh venv.
(cd "$tmp/src/client/python" && quiet "$python" setup.py sdist -d "$tmp/sdist")
sdist=$(only "$tmp"/sdist/mlaverify-*.tar.gz)
mkdir "$tmp/unpacked"
tar -C "$tmp/unpacked" -xzf "$sdist"
unpacked=$(only "$tmp"/unpacked/mlaverify-*)
for f in proto/mlaverify/v1/verify.proto VERSION; do
  [ -f "$unpacked/$f" ] || { echo "FAIL: the sdist has no $f" >&2; exit 1; }
done
quiet "$python" -m pip wheel --no-build-isolation --no-index --no-deps --no-cache-dir \
  -w "$tmp/sdist-wheel" "$unpacked"
wheel=$(only "$tmp"/sdist-wheel/mlaverify-"$version"-py3-none-any.whl)
files=$(wheel_files "$wheel")  # (read whole: see the native wheel's check below)
if grep -q '^mlaverify/lib/' <<< "$files"; then
  echo "FAIL: a wheel built without MLAVERIFY_NATIVE_LIB_PATH carries a native library" >&2
  exit 1
fi
install_wheel "$tmp/S" "$wheel"
"$tmp/S/bin/python" -c "
import sys, mlaverify, mlaverify.v1.verify_pb2
assert mlaverify.__file__.startswith(sys.prefix), mlaverify.__file__
assert mlaverify.__version__ == sys.argv[1], (mlaverify.__version__, sys.argv[1])
print('sdist -> wheel -> venv: mlaverify', mlaverify.__version__)" "$version"

# The wheel with the native library.
if [ -z "$native_lib" ]; then
  echo "native wheel: not checked (no NATIVE_LIBRARY argument: the build made none)"
  exit 0
fi
(cd "$tmp/src/client/python" && export MLAVERIFY_NATIVE_LIB_PATH=$native_lib &&
  quiet "$python" -m pip wheel --no-build-isolation --no-index --no-deps --no-cache-dir \
    -w "$tmp/native-wheel" .)
wheel=$(only "$tmp"/native-wheel/mlaverify-"$version"-*.whl)
case $wheel in
  *-py3-none-linux_*.whl) ;;
  *) echo "FAIL: $wheel: expected a py3-none-linux_<arch> tag" >&2; exit 1 ;;
esac
# The list read whole first: `wheel_files | grep -q` under pipefail fails at
# random when grep exits on its match while Python is still writing (EPIPE).
files=$(wheel_files "$wheel")
if ! grep -qx 'mlaverify/lib/libmlaverify_native.so' <<< "$files"; then
  echo "FAIL: $wheel has no mlaverify/lib/libmlaverify_native.so" >&2
  exit 1
fi
install_wheel "$tmp/N" "$wheel"
"$tmp/N/bin/python" -c "
import os, sys
from mlaverify import native
path = native.library_path()
assert path.startswith(sys.prefix) and os.path.isfile(path), path
native.load()  # raises, saying why, when it does not load
print('native wheel:', os.path.basename(sys.argv[1]), 'loads', path)" "$wheel"
"$tmp/N/bin/python" -m pytest -q -p no:cacheprovider -rs "$tmp/src/client/python/tests/test_native.py"
