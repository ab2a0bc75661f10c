#!/usr/bin/env bash
# Installs the Debian 12 packages mlaverify builds and runs with, when they
# are missing (idempotent). Needs root or sudo. README "Dependencies" says
# what each one is for.
#   scripts/install_deps.sh           everything the build, the tests and the demo use
#   scripts/install_deps.sh --build   only what building server and client needs
#                                     (the Dockerfile's build stage)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libmicrohttpd-dev prometheus-cpp-dev
  libtomlplusplus-dev
  python3
)
case ${1:-} in
  --build) ;;
  "")
    packages+=(clang libclang-rt-14-dev clang-format shellcheck
               python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch
               python3-venv python3-pip python3-setuptools python3-wheel
               prometheus yamllint python3-h2 nghttp2-proxy)
    # kubectl renders the manifests (`kubectl kustomize`) for
    # tests/k8s_check.py; a kubectl already installed from elsewhere (it
    # would conflict with Debian's) is used as it is.
    command -v kubectl >/dev/null || packages+=(kubernetes-client)
    ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    sudo="sudo"
  else
    echo "install_deps: missing ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
