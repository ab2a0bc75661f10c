#!/usr/bin/env bash
# Copies built binaries and the non-system shared libraries they load into one
# folder, so they run on a machine that has the driver but not Debian's
# gRPC/Abseil/protobuf (the GPU test machine, a slim container):
#   scripts/bundle.sh OUT_DIR BINARY...
#   LD_LIBRARY_PATH=OUT_DIR/lib OUT_DIR/bin/BINARY
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT_DIR BINARY..." >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
# Libraries every Linux with a GPU driver has (and must not be replaced).
system='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+\.|libgcc_s\.|libcuda\.|libnvidia)'
for bin in "$@"; do
  cp -f "$bin" "$out/bin/"
  # Debug info is most of a binary's size; the copy that travels needs none.
  strip --strip-debug "$out/bin/$(basename "$bin")"
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    if [[ ! $name =~ $system ]] && [ -f "$path" ]; then
      cp -fL "$path" "$out/lib/$name"
      strip --strip-debug "$out/lib/$name" 2>/dev/null || true
    fi
  done
done
echo "bundled $# binaries into $out ($(find "$out/lib" -type f | wc -l) libraries)"
