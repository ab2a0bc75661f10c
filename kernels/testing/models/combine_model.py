#!/usr/bin/env python3
"""Hand-written host model of the combine (MergeSplitRows in
kernels/verify_kernel.cuh): rows handed to 1, 2, 4 or 8 warps by the CTA's
row count, each warp's online (max, sum, o) over its round-robin splits and
the shared-memory merge of a row's warps (in the kernel each of them merges
a slice of the columns; the model merges all columns at once), against a direct log-sum-exp
merge, for split counts 2..100 with -inf LSEs and every row count a CTA can
get. Run: python3 kernels/testing/models/combine_model.py; prints the
largest error (~1e-14), rows missed (0) and -inf for an all -inf row.
"""
import math, random
NEG = -math.inf
W = 8; U = 4; BM = 32
rnd = random.Random(0)
def ex(x): return 0.0 if x == NEG else math.exp(x)
def cd(a, b): return (a + b - 1) // b


def warp_merge(lse, o, row, first, step, S):
    """One warp: splits first, first + step, ... of `row` (lane layout folded:
    the model keeps all 512 columns of the warp)."""
    m = NEG; l = 0.0; acc = [0.0] * 512
    for s0 in range(first, S, step * U):
        for u in range(U):
            s = s0 + u * step; valid = s < S
            lv = lse[s][row] if valid else NEG
            mn = max(m, lv)
            if mn == NEG: continue
            sc = ex(m - mn) if m != NEG else 0.0; wt = ex(lv - mn) if lv != NEG else 0.0
            l = l * sc + wt
            acc = [a * sc + wt * (o[s][row][c] if valid else 0.0) for c, a in enumerate(acc)]
            m = mn
    return m, l, acc


def merge_rows(lse, o, split, splits, row_end):
    """The CTA of split `split`: returns {row: (out[512], lse)}."""
    n_rows = cd(row_end - split, splits) if split < row_end else 0
    wpr = W
    while wpr > 1 and wpr * n_rows > W: wpr >>= 1
    rpr = W // wpr
    done = {}
    for rnd_ in range(0, n_rows, rpr):
        res = {}
        for w in range(W):
            i = rnd_ + w // wpr; sub = w % wpr
            if i >= n_rows: res[w] = (NEG, 0.0, [0.0] * 512); continue
            res[w] = warp_merge(lse, o, split + i * splits, sub, wpr, splits)
        for w in range(W):
            i = rnd_ + w // wpr
            if i >= n_rows or w % wpr: continue
            mx = max(res[x][0] for x in range(w, w + wpr)); ref = 0.0 if mx == NEG else mx
            tot = 0.0; out = [0.0] * 512
            for x in range(w, w + wpr):
                e = ex(res[x][0] - ref) if res[x][0] != NEG else 0.0
                tot += e * res[x][1]
                out = [a + e * b for a, b in zip(out, res[x][2])]
            inv = 1 / tot if tot > 0 else 0
            row = split + i * splits
            assert row not in done
            done[row] = ([x * inv for x in out], ref + math.log(tot) if tot > 0 else NEG)
    return done


worst = 0; missed = 0
for S in [2, 3, 7, 8, 9, 31, 32, 33, 65, 100]:
    for row_end in (BM, 5, 1):
        lse = [[rnd.gauss(0, 5) if rnd.random() > 0.3 else NEG for _ in range(BM)] for _ in range(S)]
        o = [[[rnd.gauss(0, 1) for _ in range(512)] for _ in range(BM)] for _ in range(S)]
        got = {}
        for split in range(S):
            got.update(merge_rows(lse, o, split, S, row_end))
        missed += sum(1 for r in range(row_end) if r not in got)
        for row, (out, l) in got.items():
            fin = [lse[s][row] for s in range(S) if lse[s][row] != NEG]
            if not fin: assert l == NEG; continue
            M = max(fin); w = [ex(lse[s][row] - M) for s in range(S)]; W_ = sum(w)
            ref = [sum(w[s] * o[s][row][c] for s in range(S)) / W_ for c in range(512)]
            worst = max(worst, max(abs(a - b) for a, b in zip(out, ref)), abs(l - (M + math.log(W_))))
print("max err", worst, "rows missed", missed)
lse = [[NEG] * BM for _ in range(5)]; o = [[[1.0] * 512 for _ in range(BM)] for _ in range(5)]
all_inf = merge_rows(lse, o, 0, 5, BM)[0][1]
print(all_inf)
import sys
sys.exit(0 if worst < 1e-9 and missed == 0 and all_inf == NEG else 1)
