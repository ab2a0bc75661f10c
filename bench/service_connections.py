#!/usr/bin/env python3
"""Summarises the `connections` part of bench/gpu_run.sh into one results file.

Reads the run's `mlaverify-client load --json` files
(conns-stream-c<concurrency>-<len>-n<connections>.json, each with its
bare-transport floor over the same connections, measured in the same call)
and the kernel timings of the same shapes (conns-kernel.json), and writes

  {"gpu": ..., "rows": [{"rpc", "data_plane", "concurrency", "prefix_len", "draft_len",
    "connections", "calls_per_s", "p50_us", "p95_us", "p99_us", "errors",
    "floor_connections", "floor_calls_per_s", "floor_p50_us", "kernel_us",
    "server_split_us"}, ...],
   "checks": {"c64_1k_best": {...}, "c1_16k": [...]}}

The checks are issue 35's: 64 streams inline at L=1K reach 20,000 calls/s
with no error (over the best connection count), and one stream at L=16K has
its p50 within floor + kernel + 40 us (each connection count).

  python3 bench/service_connections.py --dir RUN_DIR --out bench/results/service-h200-DATE-connections.json
"""
import argparse
import glob
import json
import os
import re

from service_planes import kernel_times  # the same kernel file format

NAME = re.compile(r"conns-(unary|stream)-c(\d+)-(\w+?)-n(\d+)\.json$")


def row_of(path, kernels):
    m = NAME.search(os.path.basename(path))
    with open(path) as f:
        r = json.load(f)
    o, g, l, fl = r["options"], r["geometry"], r["latency_ms"], r["floor"] or {}
    prefix = o["prompt_len"]
    kernel = kernels.get((o["items"], prefix, g["num_heads"]))
    return {
        "rpc": m.group(1),
        "data_plane": o["data_plane"],
        "concurrency": o["concurrency"],
        "prefix_len": prefix,
        "draft_len": g["num_drafts"],
        "connections": r["connections"],
        "calls_per_s": round(r["calls_per_second"], 1),
        "p50_us": round(l["p50"] * 1e3, 1),
        "p95_us": round(l["p95"] * 1e3, 1),
        "p99_us": round(l["p99"] * 1e3, 1),
        "errors": r["total_errors"],
        "floor_connections": fl.get("connections"),
        "floor_calls_per_s": round(fl["calls_per_second"], 1) if fl else None,
        "floor_p50_us": round(fl["p50_ms"] * 1e3, 1) if fl else None,
        "kernel_us": kernel,
        "server_split_us": r["server_split_us"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="the run's output folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kernels, gpu = kernel_times(os.path.join(args.dir, "conns-kernel.json"))
    rows = [row_of(p, kernels) for p in sorted(glob.glob(os.path.join(args.dir, "conns-*-n*.json")))
            if NAME.search(os.path.basename(p))]
    rows.sort(key=lambda r: (r["rpc"], -r["concurrency"], r["prefix_len"], r["connections"]))
    c64 = [r for r in rows if r["concurrency"] == 64 and r["prefix_len"] == 1024]
    best = max(c64, key=lambda r: r["calls_per_s"], default=None)
    c1 = []
    for r in rows:
        if r["concurrency"] != 1 or r["prefix_len"] != 16384:
            continue
        bound = (r["floor_p50_us"] + r["kernel_us"] + 40
                 if r["floor_p50_us"] is not None and r["kernel_us"] is not None else None)
        c1.append({"connections": r["connections"], "p50_us": r["p50_us"], "bound_us": bound,
                   "met": bound is not None and r["p50_us"] <= bound})
    checks = {
        "c64_1k_best": None if best is None else {
            "connections": best["connections"], "calls_per_s": best["calls_per_s"],
            "errors": best["errors"], "met": best["calls_per_s"] >= 20000 and best["errors"] == 0},
        "c1_16k": c1,
    }
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "rows": rows, "checks": checks}, f, indent=1)
        f.write("\n")
    print(f"{len(rows)} rows -> {args.out}")
    for r in rows:
        print(f"  {r['rpc']} c{r['concurrency']} L={r['prefix_len']} conns={r['connections']}: "
              f"{r['calls_per_s']} calls/s p50 {r['p50_us']} us, floor {r['floor_calls_per_s']} "
              f"calls/s p50 {r['floor_p50_us']} us, kernel {r['kernel_us']} us, errors {r['errors']}")
    print("checks:", json.dumps(checks))


if __name__ == "__main__":
    main()
