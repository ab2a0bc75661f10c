#!/usr/bin/env bash
# Speculative decoding end to end against the CUDA server, on a GPU machine:
# starts the bundled server with the model's geometry (4 layers, 8 heads,
# trees up to 16 nodes) and runs examples/spec_decode.py over each plane,
# the model on the GPU.
#   spec_decode_gpu.sh BUNDLE PYTHONPATH OUT_DIR [PLANE...]
# BUNDLE: scripts/bundle.sh's folder holding bin/mlaverify-server (a CUDA
# build) and its lib/. PYTHONPATH: a folder holding the built package
# (a copy of build/client/python/mlaverify, generated stubs included).
# PLANEs: inline system-shm cuda-shm (the default: all three).
# Writes OUT_DIR/spec-decode-PLANE.json (acceptance length, tokens/s,
# divergences), spec-decode-PLANE.log, server.log; prints a summary last.
# SPEC_DECODE_ARGS (default "--prompts 20 --tokens 64") go to every run;
# SERVER_BACKEND and MODEL_DEVICE (default cuda, cuda) allow a dry run of
# this script on a machine without a GPU (cpu, cpu); PYTHON (default
# python3) is the interpreter, with torch, grpcio and protobuf.
# Exit status: 0 when every plane that ran gave the greedy tokens (a plane
# the package cannot run, exit 2, is reported and does not fail the run).
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 BUNDLE PYTHONPATH OUT_DIR [PLANE...]" >&2
  exit 2
fi
bundle=$(realpath "$1") pypath=$(realpath "$2") out=$3
shift 3
planes=("$@")
[ ${#planes[@]} -eq 0 ] && planes=(inline system-shm cuda-shm)
here=$(dirname "$(realpath "$0")")
mkdir -p "$out"
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=$pypath PYTHONUNBUFFERED=1
read -r -a spec_args <<< "${SPEC_DECODE_ARGS:---prompts 20 --tokens 64}"
backend=${SERVER_BACKEND:-cuda} device=${MODEL_DEVICE:-cuda} python=${PYTHON:-python3}
devices=(--devices 0); [ "$backend" = cuda ] || devices=()

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
"$bundle/bin/mlaverify-server" --backend "$backend" "${devices[@]}" --layers 4 --heads 8 --page-size 64 \
  --pool-bytes 2GiB --draft-buckets 1 2 4 8 16 --batch-buckets 1 2 4 --allow-client-shm true \
  --listen 127.0.0.1:0 --admin-port -1 --port-file "$out/ports" > "$out/server.log" 2>&1 &
spid=$!
for _ in $(seq 1 600); do [ -s "$out/ports" ] && break; sleep 0.1; done
if ! [ -s "$out/ports" ]; then
  echo "the server did not start:"; cat "$out/server.log"
  kill "$spid" 2>/dev/null
  exit 1
fi
read -r gport _ < "$out/ports"
target=127.0.0.1:$gport
# NOT_SERVING until the pools are allocated and the graphs recorded.
"$python" - "$target" <<'EOF'
import sys, time
from mlaverify import VerifyClient
with VerifyClient(sys.argv[1], timeout=2) as client:
    for _ in range(600):
        try:
            if client.health() == "SERVING":
                sys.exit(0)
        except Exception:
            pass
        time.sleep(0.1)
sys.exit("the server never said SERVING")
EOF
status=$?
summary=()
if [ $status -eq 0 ]; then
  for plane in "${planes[@]}"; do
    timeout 180 "$python" "$here/spec_decode.py" --target "$target" --plane "$plane" --device "$device" \
      "${spec_args[@]}" --json "$out/spec-decode-$plane.json" > "$out/spec-decode-$plane.log" 2>&1
    rc=$?
    summary+=("$plane rc=$rc: $(tail -1 "$out/spec-decode-$plane.log")")
    case $rc in
      0|2) ;;
      *) status=1 ;;
    esac
    grep -E "^(acceptance|speculative)" "$out/spec-decode-$plane.log"
  done
fi
kill -TERM "$spid"
wait "$spid"
summary+=("server exit=$?")
rm -f "$out/ports"
printf '%s\n' "${summary[@]}"
exit $status
