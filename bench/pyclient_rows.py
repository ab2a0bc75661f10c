#!/usr/bin/env python3
"""One row of the Python-vs-C++ client latency comparison (bench/gpu_run.sh
pyclient, bench/python_client_cpu.sh): the p50 per-layer Verify latency of
the C++ client (`mlaverify-client load --json`), the pure-Python path and the
native path (bench/python_client_latency.py --json, with and without
--native), and each Python path's difference from C++; then, per client, the
mean time outside the server (mean latency minus the server's mean time per
Verify over the same window: the client's and the transport's share, less
sensitive to the server's own variation than p50 differences). A missing or
unreadable report prints as "-".

    python3 bench/pyclient_rows.py ROW CPP_JSON PY_JSON [NATIVE_JSON]
"""

import json
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def p50_us(report):
    return report["latency_ms"]["p50"] * 1e3 if report else None


def outside_us(report):
    """Mean latency minus the server's mean time (None when not reported)."""
    if not report or "server_split_us" not in report:
        return None
    return report["latency_ms"]["mean"] * 1e3 - report["server_split_us"]["server"]


def main() -> int:
    row, paths = sys.argv[1], sys.argv[2:]
    reports = [load(p) for p in (paths + [""] * 3)[:3]]
    cpp, py, nat = (p50_us(r) for r in reports)
    parts = [f"== pyclient {row}: p50 us C++ {cpp:.1f}" if cpp is not None
             else f"== pyclient {row}: p50 us C++ -"]
    for name, value in (("Python", py), ("native Python", nat)):
        if value is None:
            parts.append(f"{name} -")
        elif cpp is None:
            parts.append(f"{name} {value:.1f}")
        else:
            parts.append(f"{name} {value:.1f} ({value - cpp:+.1f})")
    print(", ".join(parts))
    outside = [outside_us(r) for r in reports]
    print(f"   outside the server, mean us: " + ", ".join(
        f"{name} {'-' if v is None else f'{v:.1f}'}"
        for name, v in zip(("C++", "Python", "native Python"), outside)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
