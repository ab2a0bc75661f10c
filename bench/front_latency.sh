#!/usr/bin/env bash
# What the HTTP/2 front (deploy/http2-front, nghttpx) adds per call: the same
# load rows against the server's own port and through the front, alternated
# round after round, against one CPU server (the service's per-call work,
# not the kernel's: 2 layers, 8 heads, N=16, sequences kept short).
#   OUT=/tmp/front bench/front_latency.sh [BUILD_DIR]   → $OUT/front-latency.json
# Rows: c1 (one inline Verify in flight: unary calls, one after another) and
# s64 (64 VerifyStreams, inline). FRONT_ROUNDS (default 3) rounds. Each
# result holds the load tool's p50/p99 latency and calls/s per path, and the
# ratio front/direct of the median p50 over the rounds.
set -euo pipefail
build=${1:-build}
src=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/mlaverify-front-latency}
rounds=${FRONT_ROUNDS:-3}
mkdir -p "$out"
server=$build/server/mlaverify-server
client=$build/client/mlaverify-client
nghttpx=$(command -v nghttpx || echo /usr/sbin/nghttpx)
[ -x "$nghttpx" ] || { echo "no nghttpx (Debian's nghttp2-proxy)" >&2; exit 1; }

rm -f "$out/ports"
"$server" --backend cpu --layers 2 --cpu-threads 1 --pool-bytes 256MiB --page-size 64 --heads 8 \
  --listen 127.0.0.1:0 --admin-port -1 --port-file "$out/ports" --log-level warn \
  > "$out/server.log" 2>&1 &
spid=$!
front_pid=""
trap 'kill "$spid" 2>/dev/null; [ -n "$front_pid" ] && kill -QUIT "$front_pid" 2>/dev/null; true' EXIT
for _ in $(seq 1 300); do [ -s "$out/ports" ] && break; sleep 0.1; done
read -r port _ < "$out/ports"
# The repository's nghttpx.conf with its frontend (a free port), backend
# (the server), workers (1: this machine's cores go to the server and the
# client) and error log replaced.
front_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
grep -vE '^(frontend|backend|workers|errorlog-file)=' "$src/deploy/http2-front/nghttpx.conf" \
  > "$out/nghttpx.conf"
printf 'frontend=127.0.0.1,%s;no-tls\nbackend=127.0.0.1,%s;;proto=h2\nworkers=1\nerrorlog-file=%s\n' \
  "$front_port" "$port" "$out/front.log" >> "$out/nghttpx.conf"
"$nghttpx" --conf="$out/nghttpx.conf" > /dev/null 2>&1 &
front_pid=$!
for _ in $(seq 1 100); do
  "$client" --target "127.0.0.1:$front_port" health > /dev/null 2>&1 && break
  sleep 0.1
done

short=(--prompt-len 1 --max-seq-len 40 --drafts 16 --progress false --warmup-s 1 --duration-s 4)
declare -A args=([c1]="--concurrency 1" [s64]="--concurrency 64 --stream")
for r in $(seq 1 "$rounds"); do
  for row in c1 s64; do
    for path in direct front; do
      target=127.0.0.1:$port
      [ "$path" = front ] && target=127.0.0.1:$front_port
      # shellcheck disable=SC2086
      "$client" --target "$target" load ${args[$row]} "${short[@]}" \
        --json "$out/$row-$path-$r.json" > "$out/$row-$path-$r.log" 2>&1 ||
        { echo "load $row $path round $r failed: $(tail -2 "$out/$row-$path-$r.log")" >&2; exit 1; }
      echo "round $r $row $path: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"p50 {d['latency_ms']['p50']:.3f} ms, p99 {d['latency_ms']['p99']:.3f} ms, {d['calls_per_second']:.0f} calls/s\")" "$out/$row-$path-$r.json")"
    done
  done
done
python3 - "$out" "$rounds" "$(nproc)" "$("$nghttpx" --version | head -1)" <<'PY'
import json, statistics, sys, datetime
out, rounds, cores, front = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
result = {"date": datetime.date.today().isoformat(), "machine_cores": cores, "front": front,
          "server": "--backend cpu --layers 2 --heads 8 --page-size 64 --cpu-threads 1",
          "load": "--prompt-len 1 --max-seq-len 40 --drafts 16 --warmup-s 1 --duration-s 4",
          "rows": {}}
for row in ("c1", "s64"):
    r = {}
    for path in ("direct", "front"):
        runs = [json.load(open(f"{out}/{row}-{path}-{i}.json")) for i in range(1, rounds + 1)]
        r[path] = {"p50_ms": [d["latency_ms"]["p50"] for d in runs],
                   "p99_ms": [d["latency_ms"]["p99"] for d in runs],
                   "calls_per_second": [d["calls_per_second"] for d in runs]}
    med = {p: statistics.median(r[p]["p50_ms"]) for p in r}
    r["front_over_direct_p50"] = med["front"] / med["direct"]
    r["front_adds_p50_ms"] = med["front"] - med["direct"]
    r["front_over_direct_calls_per_second"] = (statistics.median(r["front"]["calls_per_second"]) /
                                               statistics.median(r["direct"]["calls_per_second"]))
    result["rows"][row] = r
    print(f"{row}: p50 direct {med['direct']:.3f} ms, front {med['front']:.3f} ms "
          f"(+{r['front_adds_p50_ms'] * 1000:.0f} us, x{r['front_over_direct_p50']:.2f}); "
          f"calls/s x{r['front_over_direct_calls_per_second']:.2f}")
json.dump(result, open(f"{out}/front-latency.json", "w"), indent=1)
PY
