#!/usr/bin/env python3
"""The native Python path's excess over the C++ client, paired by round
(bench/gpu_run.sh pynative): each round ran the C++ client
(`mlaverify-client load --json`) and then the native path
(`python_client_latency.py --native --json`) against the same server, so a
round's difference is taken between neighbours in time. Prints, per row, each
round's p50s and difference and the median, min and max of the differences,
for p50 latency and for the mean time outside the server (mean latency minus
the server's mean time per Verify). Exit 0; a missing report is skipped.

    python3 bench/pyclient_rounds.py ROW CPP_1.json NATIVE_1.json [CPP_2.json NATIVE_2.json ...]
"""

import statistics
import sys

from pyclient_rows import load, outside_us, p50_us


def main() -> int:
    row, paths = sys.argv[1], sys.argv[2:]
    if not paths or len(paths) % 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    p50_diffs, outside_diffs = [], []
    for k in range(0, len(paths), 2):
        cpp, nat = load(paths[k]), load(paths[k + 1])
        if cpp is None or nat is None:
            print(f"   round {k // 2 + 1}: a report is missing")
            continue
        d = p50_us(nat) - p50_us(cpp)
        p50_diffs.append(d)
        line = (f"   round {k // 2 + 1}: p50 us C++ {p50_us(cpp):.1f}, native {p50_us(nat):.1f} "
                f"({d:+.1f})")
        oc, on = outside_us(cpp), outside_us(nat)
        if oc is not None and on is not None:
            outside_diffs.append(on - oc)
            line += f"; outside the server {oc:.1f} / {on:.1f} ({on - oc:+.1f})"
        print(line)
    for name, diffs in (("p50", p50_diffs), ("outside the server", outside_diffs)):
        if diffs:
            print(f"== pynative {row}: native - C++, {name}, over {len(diffs)} rounds: median "
                  f"{statistics.median(diffs):+.1f} us (min {min(diffs):+.1f}, "
                  f"max {max(diffs):+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
