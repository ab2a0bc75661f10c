#!/usr/bin/env python3
"""Summarises the `planes` part of bench/gpu_run.sh into one results file.

Reads the run's `mlaverify-client load --json` files (planes-<plane>-<rpc>-
c<concurrency>-<len>[-<variant>].json, each with its bare-transport floor) and
the kernel timings of the same shapes (planes-kernel.json, mlaverify-bench),
and writes

  {"gpu": ..., "rows": [{"mode", "heads", "data_plane", "rpc", "concurrency", "items",
    "prefix_len", "draft_len", "calls_per_s", "items_per_s", "p50_us",
    "p99_us", "errors", "kernel_us", "floor_p50_us", "floor_calls_per_s",
    "server_split_us", "variant"}, ...],
   "append": [{"data_plane", "concurrency", "prompt_len", "gb_per_s",
    "gb_per_s_aggregate", "variant"}, ...]}

  python3 bench/service_planes.py --dir RUN_DIR --out bench/results/service-h200-DATE.json
"""
import argparse
import glob
import json
import os
import re

NAME = re.compile(r"planes-(inline|shm|cuda-shm)-(unary|stream)-c(\d+)-(\w+?)(?:-(.+))?\.json$")


def kernel_times(path):
    """(batch, prefix_len, heads) -> kernel time in us (N=16, tree, page 64)."""
    if not os.path.exists(path):
        return {}, None
    with open(path) as f:
        bench = json.load(f)
    return ({(r["batch"], r["prefix_len"], r["heads"]): r["time_us"] for r in bench["rows"]},
            bench.get("gpu"))


def smi_gpu_name(path):
    """The card's name from the run's nvidia-smi CSV (gpu_run.sh writes it
    first), for runs without kernel timings; None without the file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = f.read().splitlines()
    return lines[1].split(",")[0].strip() if len(lines) > 1 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="the run's output folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kernels, gpu = kernel_times(os.path.join(args.dir, "planes-kernel.json"))
    if gpu is None:
        gpu = smi_gpu_name(os.path.join(args.dir, "nvidia_smi.csv"))
    rows, appends = [], []
    for path in sorted(glob.glob(os.path.join(args.dir, "planes-*.json"))):
        m = NAME.search(os.path.basename(path))
        if not m:
            continue
        plane, rpc, _, _, variant = m.groups()
        if variant and variant.startswith("items"):
            variant = None  # the items count is a field of its own
        # TP rows and their single-device twins say so in the name.
        mode = variant if variant in ("single", "tp", "dp") else "single"
        if variant in ("single", "tp", "dp"):
            variant = None
        with open(path) as f:
            load = json.load(f)
        o = load["options"]
        floor = load.get("floor") or {}
        prefix = o["prompt_len"]
        kernel = kernels.get((o.get("items", 1), prefix, load["geometry"]["num_heads"]))
        rows.append({
            "mode": mode,
            "heads": load["geometry"]["num_heads"],
            "data_plane": plane,
            "rpc": rpc,
            "concurrency": o["concurrency"],
            "items": o.get("items", 1),
            "prefix_len": prefix,
            "draft_len": load["geometry"]["num_drafts"],
            "calls_per_s": round(load["calls_per_second"], 1),
            "items_per_s": round(load.get("items_per_second", load["calls_per_second"]), 1),
            "p50_us": round(load["latency_ms"]["p50"] * 1e3, 1),
            "p99_us": round(load["latency_ms"]["p99"] * 1e3, 1),
            "errors": load["total_errors"],
            "pages_returned": not load["page_leak"] and not load["pages_unchecked"],
            "kernel_us": round(kernel, 1) if kernel is not None else None,
            "floor_p50_us": round(floor["p50_ms"] * 1e3, 1) if floor else None,
            "floor_calls_per_s": round(floor["calls_per_second"], 1) if floor else None,
            "floor_message_bytes": [floor.get("request_bytes"), floor.get("reply_bytes")]
            if floor else None,
            "server_split_us": {k: round(v, 1) for k, v in load["server_split_us"].items()},
            # An A/B row's change from the defaults (tuned HTTP/2, 100 us spin).
            "variant": variant,
        })
        a = load.get("append", {})
        if a.get("bytes"):
            # cuda-shm rows upload their prompts inline (AppendKv takes inline
            # bytes or system shared memory).
            appends.append({
                "data_plane": "inline" if plane == "cuda-shm" else plane,
                "with_rows_of": plane,
                "rpc": rpc,
                "concurrency": o["concurrency"],
                "prompt_len": prefix,
                "gb_per_s": round(a["gb_per_s_per_call"], 3),
                "gb_per_s_aggregate": round(a["gb_per_s_ramp_up"], 3),
                "variant": variant,
            })
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "rows": rows, "append": appends}, f, indent=1)
        f.write("\n")
    for r in rows:
        print(f"{r['mode']:6} H={r['heads']:<3} {r['data_plane']:8} {r['rpc']:6} c{r['concurrency']:<3} "
              f"items {r['items']:<3} "
              f"L={r['prefix_len']:<6} p50 {r['p50_us']:8.1f} us (floor {r['floor_p50_us']}) "
              f"{r['calls_per_s']:9.1f} calls/s (floor {r['floor_calls_per_s']}) "
              f"{r['items_per_s']:9.1f} items/s  kernel {r['kernel_us']}  [{r['variant']}]")
    for a in appends:
        print(f"append {a['data_plane']:8} c{a['concurrency']:<3} L={a['prompt_len']:<6} "
              f"{a['gb_per_s']:.3f} GB/s per call, {a['gb_per_s_aggregate']:.3f} aggregate "
              f"[{a['variant']}]")


if __name__ == "__main__":
    main()
