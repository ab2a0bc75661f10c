#!/usr/bin/python3
"""Turns one bench/gpu_run.sh result folder into the committed report.

    /usr/bin/python3 bench/report.py RUN_DIR --name h200-2026-11-29   (Debian python3-matplotlib)

Reads RUN_DIR/{anchor,sweep,triton_anchor,triton_sweep}.json (written by
mlaverify-bench and bench/baselines/triton_extend.py in the same device call),
writes bench/results/NAME.json (both implementations' rows plus the speed-up of
each anchor row), bench/results/NAME.png (time against prefix length: this
kernel, the Triton baseline and the floor), and prints bench/RESULTS.md's markdown
table. Nothing here measures anything: every number comes from the JSON.
"""
import argparse
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def key(row):
    # The Triton baseline's rows carry no kv_dtype: they read bf16 rows.
    return (row["batch"], row["prefix_len"], row["draft_len"], row["heads"], row["page_size"],
            row["mask"], row.get("kv_dtype", "bf16"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--name", required=True, help="e.g. h200-2026-11-29")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    anchor = load(os.path.join(args.run_dir, "anchor.json"))
    sweep = load(os.path.join(args.run_dir, "sweep.json"))
    triton_anchor = load(os.path.join(args.run_dir, "triton_anchor.json"))
    triton_sweep_path = os.path.join(args.run_dir, "triton_sweep.json")
    triton_sweep = load(triton_sweep_path) if os.path.exists(triton_sweep_path) else {"rows": []}

    triton_by_key = {key(r): r for r in triton_anchor["rows"] + triton_sweep["rows"]}
    rows = []
    for r in anchor["rows"]:
        t = triton_by_key.get(key(r))
        rows.append(dict(r, triton_time_us=t["time_us"] if t else None,
                         speedup_vs_triton=(t["time_us"] / r["time_us"]) if t else None))
    report = {
        "gpu": anchor["gpu"],
        "read_tbps": anchor["read_tbps"],
        "flop_roof_tflops": anchor["flop_roof_tflops"],
        "kernel_config": {k: anchor[k] for k in anchor if k not in ("rows", "gpu", "read_tbps")},
        "rows": rows,
        "sweep": sweep["rows"],
        "triton": {"impl": triton_anchor.get("impl"), "torch": triton_anchor.get("torch"),
                   "triton": triton_anchor.get("triton"),
                   "rows": triton_anchor["rows"] + triton_sweep["rows"]},
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, args.name + ".json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")

    # "plan reused": the same launch as a verify step's later layers run it
    # (VerifyLaunchConfig::reuse_plan), when the run measured it.
    reused = any("time_us_reused_plan" in r for r in rows)
    # A KV column when the run has fp8 rows (mlaverify-bench --kv-dtype fp8|both).
    kv = any(r.get("kv_dtype", "bf16") != "bf16" for r in rows)
    print("| B | L | N | H | page | mask |%s µs |%s TB/s | TFLOP/s | × floor | Triton µs | speed-up | rel err |"
          % (" KV |" if kv else "", " plan reused µs |" if reused else ""))
    print("|--:|--:|--:|--:|--:|---|%s--:|%s--:|--:|--:|--:|--:|--:|"
          % ("---|" if kv else "", "--:|" if reused else ""))
    for r in rows:
        tri = "%.1f" % r["triton_time_us"] if r["triton_time_us"] else "–"
        spd = "%.1f×" % r["speedup_vs_triton"] if r["speedup_vs_triton"] else "–"
        rp = ""
        if reused:
            rp = " %s |" % ("%.1f" % r["time_us_reused_plan"] if "time_us_reused_plan" in r else "–")
        kv_cell = " %s |" % r.get("kv_dtype", "bf16") if kv else ""
        print("| %d | %d | %d | %d | %d | %s |%s %.1f |%s %.2f | %.0f | %.2f | %s | %s | %.1e |" % (
            r["batch"], r["prefix_len"], r["draft_len"], r["heads"], r["page_size"], r["mask"],
            kv_cell, r["time_us"], rp, r["tbps"], r["tflops"], r["time_over_floor"], tri, spd,
            r["rel_err"]))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    # The plot compares bf16 rows with the (bf16) Triton baseline.
    sweep_rows = sorted((r for r in sweep["rows"] if r.get("kv_dtype", "bf16") == "bf16"),
                        key=lambda r: r["prefix_len"])
    xs = [r["prefix_len"] for r in sweep_rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["time_us"] for r in sweep_rows], "o-", label="mlaverify kernel")
    ax.plot(xs, [r["floor_us"] for r in sweep_rows], "--", color="gray", label="floor (bytes, flops)")
    tri = sorted((r for r in triton_sweep["rows"] if r["batch"] == 1), key=lambda r: r["prefix_len"])
    if tri:
        ax.plot([r["prefix_len"] for r in tri], [r["time_us"] for r in tri], "s-",
                label="Triton extend baseline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length L (tokens)")
    ax.set_ylabel("time (µs, median, cold L2)")
    ax.set_title("Verify attention, B=1, N=16 tree, H=8, page 64 — %s" % anchor["gpu"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out_dir, args.name + ".png")
    fig.savefig(png, dpi=120)
    print("wrote", json_path, "and", png, file=sys.stderr)


if __name__ == "__main__":
    main()
