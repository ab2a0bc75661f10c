#!/usr/bin/env python3
"""Summarises the per-SASS-instruction CSV of `bench/gpu_run.sh stalls`
(ncu --page source --csv --print-source sass) for the loops of one kernel.

    bench/research/sass_profile.py stalls_sass.csv --hot 0.5
        lists the instructions executed at least 0.5 x the most executed one
        (the inner loops), with offset, count, samples and top stall reasons;
        read the loop boundaries (offsets) off this list.
    bench/research/sass_profile.py stalls_sass.csv --loop pv:900:1b60 --loop score:7000:8700 --per 131200
        per loop (offsets in hex, inclusive): samples and stall reasons, and
        instructions per iteration by opcode (executions / --per, e.g. the
        loop's warp-iterations: its most executed instruction's count).
    bench/research/sass_profile.py stalls_sass.csv --timer-sections
        (a phase-stamps build) cuts the code at every %globaltimer read and
        prints, per section in code order: offsets, static instructions,
        executions, samples and the top stall reasons; then the whole
        kernel's stall reasons. Shows where a small launch's straight-line
        phases (plan, merge) wait, e.g. on instruction fetch (no_inst).
    bench/research/sass_profile.py stalls_sass.csv[.gz] --loops
        finds the hot loops itself (runs of instructions executed at least
        0.9 x the most executed one, gaps under 0x1000 bytes bridged) and
        prints for each what --loop prints, with --per set to its most
        executed instruction's count, plus its eight instructions with the
        most samples (the stall profile of bench/NOTES.md, "The tile"; CTest's
        sass_profile_finds_loops runs it on that profile, testdata/).
    bench/research/sass_profile.py stalls_sass.csv --regions 0x800
        (any build) per 0x800-byte slice of the code that ran: executions,
        the most any one instruction ran (132 = one warp per CTA, 1,024 =
        eight warps of 128 CTAs, ...), samples and top stall reasons. How the
        merge was found waiting on instruction fetch (bench/NOTES.md, "The merge").
"""
import argparse
import collections
import csv
import gzip


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    out = []
    for r in data:
        src = r[1].strip()
        toks = src.split()
        op = (toks[1] if toks[0].startswith("@") else toks[0]).split(".")[0]
        out.append({
            "off": int(r[0], 16) - base,
            "src": src,
            "op": op,
            "exec": int(r[col["Instructions Executed"]] or 0),
            "samples": int(r[col["# Samples"]] or 0),
            "stalls": collections.Counter({h[6:]: int(r[col[h]] or 0) for h in stalls}),
        })
    return out


def summarise(instrs):
    """Executions, the most any one instruction ran, samples and stall reasons of a slice."""
    why = collections.Counter()
    for i in instrs:
        why.update(i["stalls"])
    return {"exec": sum(i["exec"] for i in instrs), "max": max((i["exec"] for i in instrs), default=0),
            "samples": sum(i["samples"] for i in instrs), "why": why}


def hot_loops(ins, fraction=0.9, gap=0x1000):
    """(first offset, last offset, most executions) of each run of hot instructions."""
    top = max(i["exec"] for i in ins)
    runs = []
    for i in ins:
        if i["exec"] < fraction * top:
            continue
        if runs and i["off"] - runs[-1][1] < gap:
            runs[-1][1] = i["off"]
        else:
            runs.append([i["off"], i["off"]])
    return [(lo, hi, max(i["exec"] for i in ins if lo <= i["off"] <= hi)) for lo, hi in runs]


def print_loop(name, ins, lo, hi, per, total, hotspots=0):
    sel = [i for i in ins if lo <= i["off"] <= hi]
    g = summarise(sel)
    samples, why = g["samples"], g["why"]
    ops = collections.Counter()
    op_samples = collections.Counter()
    for i in sel:
        ops[i["op"]] += i["exec"] / per
        op_samples[i["op"]] += i["samples"]
    print(f"== {name}: {samples} samples ({100 * samples / total:.1f} % of {total}), "
          f"{sum(ops.values()):.1f} instructions per iteration")
    print("   stalls: " + " ".join(f"{k}:{v}" for k, v in why.most_common(8)))
    for op, n in ops.most_common(24):
        print(f"   {op:10s} {n:6.1f} per iteration, {op_samples[op]:5d} samples")
    if hotspots:
        print(f"   the {hotspots} instructions with the most samples (share of the loop's):")
        for i in sorted(sel, key=lambda i: -i["samples"])[:hotspots]:
            print(f"   {i['off']:6x} {100 * i['samples'] / max(samples, 1):5.1f} %  {i['src'][:56]:56s} "
                  f"{top_reasons(i['stalls'], 3)}")


def top_reasons(why, n):
    return " ".join(f"{k}:{v}" for k, v in why.most_common(n) if v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--hot", type=float)
    ap.add_argument("--loop", action="append", default=[])
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--timer-sections", action="store_true")
    ap.add_argument("--regions", type=lambda x: int(x, 0))
    ap.add_argument("--loops", action="store_true")
    a = ap.parse_args()
    ins = load(a.csv)
    total = sum(i["samples"] for i in ins)
    if a.regions:
        slices = collections.OrderedDict()
        for i in ins:
            slices.setdefault(i["off"] // a.regions, []).append(i)
        for k, group in slices.items():
            g = summarise(group)
            if g["exec"]:
                print(f"{k * a.regions:6x} exec {g['exec']:9d} max {g['max']:6d} samples {g['samples']:6d}  "
                      f"{top_reasons(g['why'], 4)}")
    if a.timer_sections:
        sections, cur = [], []
        for i in ins:
            cur.append(i)
            if "GLOBALTIMER" in i["src"]:
                sections.append(cur)
                cur = []
        if cur:
            sections.append(cur)
        overall = collections.Counter()
        for sec in sections:
            g = summarise(sec)
            overall.update(g["why"])
            print(f"{sec[0]['off']:6x}-{sec[-1]['off']:6x} {len(sec):5d} instr {g['exec']:9d} exec "
                  f"{g['samples']:6d} samples  {top_reasons(g['why'], 4)}")
        print("whole kernel: " + top_reasons(overall, 12))
    if a.hot is not None:
        top = max(i["exec"] for i in ins)
        for i in ins:
            if i["exec"] >= a.hot * top:
                why = " ".join(f"{k}:{v}" for k, v in i["stalls"].most_common(3) if v)
                print(f"{i['off']:6x} {i['exec']:9d} {i['samples']:5d} {i['src'][:60]:60s} {why}")
    for spec in a.loop:
        name, lo, hi = spec.split(":")
        print_loop(name, ins, int(lo, 16), int(hi, 16), a.per, total)
    if a.loops:
        for lo, hi, most in hot_loops(ins):
            print_loop(f"loop {lo:x}-{hi:x} ({most} iterations)", ins, lo, hi, most, total, hotspots=8)


if __name__ == "__main__":
    main()
