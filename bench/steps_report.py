#!/usr/bin/env python3
"""Summarises a `bench/gpu_run.sh steps` run folder into one JSON (stdout):
every `load --steps` row with the kernel's time for the same batch (from
steps-kernel.json, same call) and the doorbell probe's floor, today's
per-layer VerifyStream row, the killed-scheduler check, and each target of
the device-driven step issue judged against its row. A short table goes to
stderr.

    python3 bench/steps_report.py RUN_FOLDER > steps.json
"""
import json
import pathlib
import re
import sys


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main():
    run = pathlib.Path(sys.argv[1])
    kernel = {}
    k = load(run / "steps-kernel.json")
    for row in (k or {}).get("rows", []):
        key = (row["batch"], row["prefix_len"], row["draft_len"], row["heads"])
        kernel[key] = {"time_us": row.get("time_us"), "reused_plan_us": row.get("reused_plan_us")}
    probes = {}
    for p in sorted(run.glob("probe-*.json")):
        j = load(p)
        if j:
            probes[p.stem] = j
    rows = {}
    for p in sorted(run.glob("steps-*.json")):
        if p.name in ("steps-kernel.json",):
            continue
        j = load(p)
        if not j:
            continue
        rows[p.stem[len("steps-"):]] = j

    def step_row(name, batch, prefix, heads):
        r = rows.get(name)
        if not r or r.get("mode") != "steps":
            return None
        if not r["steps"]:
            # No step in the window: nothing measured (the error says why).
            out["empty_rows"][name] = r["first_error"] or "no step completed in the window"
            return None
        kern = kernel.get((batch, prefix, 16, heads), {})
        return {
            "pass": r["pass"],
            "steps": r["steps"],
            "steps_per_second": r["steps_per_second"],
            "layer_us_p50": r["layer_us"]["p50"],
            "layer_us_p90": r["layer_us"]["p90"],
            "layer_us_p99": r["layer_us"]["p99"],
            "layers_ms_p50": r["layers_ms"]["p50"],
            "step_ms_p50": r["step_ms"]["p50"],
            "open_ms_p50": r["open_ms"]["p50"],
            "commit_ms_p50": r["commit_ms"]["p50"],
            "client_work_us": r["options"]["client_work_us"],
            "doorbell": r["options"]["doorbell"],
            "layers": r["num_layers"],
            "kernel_us": kern.get("time_us"),
            "kernel_reused_plan_us": kern.get("reused_plan_us"),
            "errors": r["total_errors"],
            "first_error": r["first_error"],
        }

    out = {"what": "device-driven verify steps (docs/steps.md), bench/gpu_run.sh steps",
           "kernel": {f"{b},{l},{n},{h}": v for (b, l, n, h), v in kernel.items()},
           "probe": probes, "rows": {}, "empty_rows": {}, "targets": []}
    shapes = {
        "gpu-1x16k": (1, 16384, 8), "gpu-1x16k-work50": (1, 16384, 8), "gpu-32x1k": (32, 1024, 8),
        "gpu-1x4k-c4": (1, 4096, 8),        "host-1x16k": (1, 16384, 8), "gpu-1x16k-h16": (1, 16384, 16),
        "gpu-1x16k-tp00": (1, 16384, 16), "kill-after": (1, 4096, 8),
    }
    for name, (b, l, h) in shapes.items():
        row = step_row(name, b, l, h)
        if row:
            out["rows"][name] = row
    v = rows.get("verify-1x16k")
    if v:
        out["rows"]["verify-1x16k"] = {"layer_us_p50": v["latency_ms"]["p50"] * 1e3,
                                       "server_split_us": v.get("server_split_us")}

    def target(name, row, limit, value, what):
        if value is None or limit is None:
            out["targets"].append({"target": name, "row": row, "met": None, "why": "not measured"})
            return
        out["targets"].append({"target": name, "row": row, "value": round(value, 2),
                               "limit": round(limit, 2), "met": bool(value <= limit), "what": what})

    r = out["rows"]
    g = r.get("gpu-1x16k")
    if g and g["kernel_us"]:
        target("1 item L=16K GPU doorbells: layer p50 <= kernel + 10 us", "gpu-1x16k",
               g["kernel_us"] + 10, g["layer_us_p50"], "us")
        target("a 61-layer step <= 61 x (kernel + 10 us)", "gpu-1x16k",
               g["layers"] * (g["kernel_us"] + 10) / 1e3, g["layers_ms_p50"], "ms")
    g = r.get("gpu-32x1k")
    if g and g["kernel_us"]:
        target("32 items L=1K: layer p50 <= kernel + 12 us", "gpu-32x1k", g["kernel_us"] + 12,
               g["layer_us_p50"], "us")
    g = r.get("gpu-1x16k-work50")
    if g and g["kernel_us"]:
        target("client work 50 us: step <= 61 x (50 + kernel + 15 us)", "gpu-1x16k-work50",
               g["layers"] * (50 + g["kernel_us"] + 15) / 1e3, g["layers_ms_p50"], "ms")
    g = r.get("host-1x16k")
    if g and g["kernel_us"]:
        target("host doorbells 1 item L=16K: layer p50 <= kernel + 25 us", "host-1x16k",
               g["kernel_us"] + 25, g["layer_us_p50"], "us")
    one, tp = r.get("gpu-1x16k-h16"), r.get("gpu-1x16k-tp00")
    if one and tp:
        target("TP over device 0 twice at 16 heads: layer p50 within 10% of one device",
               "gpu-1x16k-tp00", one["layer_us_p50"] * 1.10, tp["layer_us_p50"], "us")
    metrics = (run / "steps-kill-metrics.txt")
    if metrics.exists():
        text = metrics.read_text()

        def value(pattern):
            m = re.search(pattern + r"\s+([0-9.e+]+)", text)
            return float(m.group(1)) if m else None

        aborted = value(r'mlaverify_device_steps_ended_total\{outcome="aborted",reason="layer_timeout"\}')
        free = value(r"mlaverify_kv_pages_free")
        cap = value(r"mlaverify_kv_pages_capacity")
        after = r.get("kill-after")
        out["kill"] = {"aborted_by_layer_timeout": aborted, "pages_free": free,
                       "pages_capacity": cap, "next_steps_pass": bool(after and after["pass"])}
        out["targets"].append({
            "target": "scheduler killed mid-step: aborted at the timeout, every page back, next "
                      "steps pass", "met": bool(aborted and aborted >= 1 and free == cap
                                              and after and after["pass"])})
    json.dump(out, sys.stdout, indent=2)
    print()
    for name, row in r.items():
        if "layer_us_p50" in row and "kernel_us" in row:
            print(f"{name:20s} layer p50 {row['layer_us_p50']:8.1f} us  kernel {row['kernel_us']}"
                  f"  layers {row['layers_ms_p50']:.2f} ms  steps/s {row['steps_per_second']:.1f}"
                  f"  errors {row['errors']}", file=sys.stderr)
        else:
            print(f"{name:20s} {row}", file=sys.stderr)
    for t in out["targets"]:
        print(f"{'MET ' if t['met'] else 'MISS' if t['met'] is False else '----'} {t['target']}"
              f" ({t.get('value')} vs {t.get('limit')})", file=sys.stderr)
    for name, p in probes.items():
        print(f"probe {name}: cycle p50 {p['cycle_us_p50']:.2f} us, hops {p['hops_us_p50']:.2f} us",
              file=sys.stderr)


if __name__ == "__main__":
    main()
