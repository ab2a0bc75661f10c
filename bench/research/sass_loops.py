#!/usr/bin/env python3
"""Innermost loops of a kernel's SASS that issue MMAs, with instruction counts.

Reads `cuobjdump -sass` (or `nvdisasm`) text of one or more kernels and
prints, per kernel with MMAs, for every innermost backward-branch loop that
contains HMMA, its address range
and how many instructions, HMMA, LDSM, BAR, LDGSTS and WARPSYNC it holds,
plus the kernel's total WARPSYNC count. Used to compare the tile loops of
two builds before reading an A/B (bench/NOTES.md, "Reading an A/B": a trap near the
segment loop put WARPSYNC.ALL into the tile loops and cost 4 %).

  cuobjdump -sass [-fun MANGLED_NAME] mlaverify-bench > k.sass   (GPU machine;
  bench/gpu_run.sh sass does this and writes sass_loops.txt)
  python3 bench/research/sass_loops.py k.sass [other.sass ...]
"""
import re
import sys

KINDS = ("HMMA", "LDSM", "BAR", "LDGSTS", "WARPSYNC")


def parse(path):
    """{function name: [(address, instruction)]} of a cuobjdump/nvdisasm dump."""
    functions = {}
    current = functions.setdefault("?", [])
    with open(path) as f:
        for line in f:
            header = re.search(r"Function : (\S+)", line)
            if header:
                current = functions.setdefault(header.group(1), [])
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                current.append((int(m.group(1), 16), m.group(2).strip()))
    return {name: instrs for name, instrs in functions.items() if instrs}


def loops(instrs):
    index = {a: i for i, (a, _) in enumerate(instrs)}
    found = []
    for i, (addr, text) in enumerate(instrs):
        if "BRA" not in text:
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            body = [t for _, t in instrs[index[target]:i + 1]]
            counts = {k: sum(k in t for t in body) for k in KINDS}
            found.append((target, addr, len(body), counts))
    with_mma = [l for l in found if l[3]["HMMA"] > 0]
    return [l for l in with_mma
            if not any(o is not l and l[0] <= o[0] and o[1] <= l[1] for o in with_mma)]


def main():
    for path in sys.argv[1:]:
        for name, instrs in parse(path).items():
            inner = sorted(loops(instrs))
            if not inner:
                continue  # no MMA loop: not an attention kernel
            total_ws = sum("WARPSYNC" in t for _, t in instrs)
            print(f"{path}: {name}: {len(instrs)} instructions, {total_ws} WARPSYNC")
            for lo, hi, n, c in inner:
                kinds = ", ".join(f"{c[k]} {k}" for k in KINDS)
                print(f"  loop {lo:05x}-{hi:05x}: {n} instructions, {kinds}")


if __name__ == "__main__":
    main()
