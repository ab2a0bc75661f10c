#!/usr/bin/env python3
"""Hand-written host model of the work plan (kernels/verify_kernel.cuh):
PlanKernel (one thread per request, block scans) against PlanInWarp (one
warp, lane = request) on random batches with padding requests, for both the
chunk plan and the stream plan. Checks that both paths decide the same plan,
that every (request, row tile) covers its KV range exactly once, that split
segments write distinct partial slots inside the workspace (2 * T), that
the combine finds every split's slot and merges every row once, and that the
fused combine's arrival key of a split row tile (SplitTileKey) is the same
for all its splits, below T, and not shared with another row tile.
Also prints how the stream plan's longest range compares with the chunk
plan's on uniform batches. Run: python3 kernels/testing/models/plan_model.py
(~35 s); prints "mismatches 0".
"""
import random
BM = 32; BN = 32; NOSPLIT = (1 << 30) // BN; INT_MAX = 2**31 - 1; STREAM_MIN_GAIN_TILES = 5
cd = lambda a, b: (a + b - 1) // b


def shapes(batch, pre, dr, H, lanes):
    out = []
    for b in range(lanes):
        if b < batch:
            n = dr[b]; kv = pre[b] + n; rt = cd(n * H, BM); ti = cd(kv, BN) if n > 0 else 0
        else:
            n = kv = rt = ti = 0
        out.append((n, kv, rt, ti))
    return out


def chunk_of(sh, T, minc):
    cost = sum(r * t for _, _, r, t in sh); R = sum(r for _, _, r, _ in sh)
    cl = lambda c: min(max(c, minc), NOSPLIT)
    tight = safe = NOSPLIT
    if R < T:
        sp = T - R; safe = cl(cd(cost, sp)); tight = cl(cd(cost, T))
    ti = sum(r * cd(t, tight) if t > 0 else 0 for _, _, r, t in sh)
    return tight if ti <= T else safe


def stream_groups(sh, T, minc, items, longest, enabled):
    act = [r for _, _, r, t in sh if t > 0]
    length = sum(t for *_, t in sh)
    if not enabled or length == 0 or length > INT_MAX or min(act) != max(act) or max(act) > T:
        return 0
    rt = max(act)
    g = min(T // rt, cd(length, minc))
    return g if cd(length, g) + STREAM_MIN_GAIN_TILES <= cd(items, T) * longest else 0


def start_of(g, G, L): return g * L // G
def range_of(pos, G, L): return ((pos + 1) * G - 1) // L


def plan(batch, pre, dr, H, T, minc, maxw, lanes, find_request, stream_enabled):
    """Summary, work list (chunk plan), per-request arrays. Mirrors PlanKernel /
    PlanInWarp; the two differ in how many requests they scan and in the
    lookup of the request that holds item w."""
    sh = shapes(batch, pre, dr, H, lanes); c = chunk_of(sh, T, minc)
    splits = [cd(t, c) if t > 0 else 0 for _, _, _, t in sh]
    longest = max(cd(t, s) if s > 0 else 0 for (_, _, _, t), s in zip(sh, splits))
    base = []; acc = 0
    for (n, kv, rt, t), s in zip(sh, splits): base.append(acc); acc += rt * s
    items = acc
    G = stream_groups(sh, T, minc, items, longest, stream_enabled)
    RT = max((r for _, _, r, t in sh if t > 0), default=0)
    L = sum(t for *_, t in sh)
    q_row = []; a = 0
    for n, *_ in sh: q_row.append(a); a += n
    sstart = []; a = 0
    for *_, t in sh: sstart.append(a); a += t
    summary = (G * RT if G else items, G, RT if G else 0, L if G else 0)
    work = []
    if not G:
        for w in range(maxw):
            if w < items:
                r = find_request(base, batch, w)
                work.append(make_item(r, w - base[r], sh[r][2], sh[r][1], c, q_row[r], w))
            else:
                work.append(None)
    return summary, work, q_row[:batch], sstart[:batch]


def make_item(r, local, rt, kv, c, q_row, w):
    tiles = cd(kv, BN); sp = cd(tiles, c); s = local // rt
    return (r, local % rt, s, (s * tiles // sp) * BN, min(kv, ((s + 1) * tiles // sp) * BN), q_row, sp,
            -1 if sp == 1 else w)


def kernel_lookup(base, batch, w):  # PlanKernel: binary search over the bases
    lo, hi = 0, batch - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if base[mid] <= w: lo = mid
        else: hi = mid - 1
    return lo


def warp_lookup(base, batch, w):  # PlanInWarp: ballot of lanes at or below w, highest set bit
    bal = sum(1 << l for l in range(32) if l < batch and base[l] <= w)
    return bal.bit_length() - 1


def collect(batch, pre, dr, H, summary, sstart, q_rows, x, b0):
    """CollectStreamSegments: segments of CTA x among requests b0..b0+31, and next."""
    total, G, RT, L = summary
    g = x // RT; lo = start_of(g, G, L); hi = start_of(g + 1, G, L)
    out = []; last_end = None
    for lane in range(32):
        b = b0 + lane
        if b < batch:
            n = dr[b]; kv = pre[b] + n; tiles = cd(kv, BN) if n > 0 else 0; st = sstart[b]
        else:
            kv = tiles = 0; st = L
        end = st + tiles
        if lane == 31: last_end = end
        if tiles > 0 and st < hi and end > lo:
            sl = max(st, lo); shi = min(end, hi); first = range_of(st, G, L)
            sp = range_of(end - 1, G, L) - first + 1
            out.append((b, x % RT, g - first, (sl - st) * BN, min((shi - st) * BN, kv), q_rows[b], sp,
                        -1 if sp == 1 else 2 * x + (1 if sl > lo else 0)))
    nxt = b0 + 32 if b0 + 32 < batch and last_end < hi else -1
    return out, nxt


def first_block(batch, summary, sstart, x):
    total, G, RT, L = summary
    lo = start_of(x // RT, G, L)
    lanes = [l for l in range(32) if l * 32 < batch and sstart[l * 32] <= lo]
    return 32 * max(lanes)


EMPTY_BLOCKS = [0]


def segments_of(batch, pre, dr, H, summary, work, q_rows, sstart, x, warp_plan):
    """ForEachSegment for CTA x: its segments in order."""
    total, G, RT, L = summary
    if x >= total: return []
    if G == 0: return [work[x]]
    b0 = 0 if warp_plan else first_block(batch, summary, sstart, x)
    segs = []
    while True:
        s, nxt = collect(batch, pre, dr, H, summary, sstart, q_rows, x, b0)
        if not s and nxt >= 0: EMPTY_BLOCKS[0] += 1  # ForEachSegment's count == 0 path
        segs += s
        if nxt < 0: return segs
        b0 = nxt


def combine_slots(summary, item, x, sstart):
    """The slots the combine CTA x reads for the splits of item's row tile."""
    total, G, RT, L = summary
    b, rt, split, kb, ke, q, sp, slot = item
    if G == 0:
        rts = None  # chunk: slot_base = slot - split * row_tiles, stride row_tiles
        return None
    first = x // RT - split
    extra = 1 if sstart[b] > start_of(first, G, L) else 0
    base = 2 * (first * RT + rt)
    return [base + j * 2 * RT + (extra if j == 0 else 0) for j in range(sp)]


def check(batch, pre, dr, H, T, minc, stream_enabled):
    maxrt = cd(max(max(dr), 1) * H, BM); maxw = max(T, batch * maxrt)
    res = {}
    for name, lanes, lookup, warp in (("kernel", 1024, kernel_lookup, False), ("warp", 32, warp_lookup, True)):
        if warp and batch > 32: continue
        summary, work, q_rows, sstart = plan(batch, pre, dr, H, T, minc, maxw, lanes, lookup, stream_enabled)
        segs = {x: segments_of(batch, pre, dr, H, summary, work, q_rows, sstart, x, warp) for x in range(maxw)}
        res[name] = (summary, segs)
        total, G, RT, L = summary
        assert total <= maxw
        # Coverage: every (request, row tile) covers [0, kv) exactly once.
        by_tile = {}
        slots = {}
        fused_keys = {}
        for x, ss in segs.items():
            assert sum(1 for it in ss if it[7] >= 0 and it[7] // 2 == x and G) <= 2
            for it in ss:
                b, rt, split, kb, ke, q, sp, slot = it
                assert ke > kb
                by_tile.setdefault((b, rt), []).append((kb, ke, split, sp, slot, x))
                if slot >= 0:
                    assert slot not in slots, ("slot reused", slot)
                    assert slot < 2 * T
                    slots[slot] = (b, rt, split)
        for b in range(batch):
            if dr[b] == 0: continue
            kv = pre[b] + dr[b]
            for rt in range(cd(dr[b] * H, BM)):
                segl = sorted(by_tile[(b, rt)])
                assert segl[0][0] == 0 and segl[-1][1] == kv
                assert all(segl[i][1] == segl[i + 1][0] for i in range(len(segl) - 1))
                sp = len(segl)
                assert all(s[3] == sp and s[2] == i for i, s in enumerate(segl)), segl
                assert (sp == 1) == (segl[0][4] < 0)
                if sp > 1:
                    # The fused combine's arrival counter of this row tile
                    # (SplitTileKey): every split computes the same key, below T,
                    # and no other split row tile shares it.
                    keys = set()
                    for kb, ke, split, _, slot, x in segl:
                        if G:
                            keys.add((x // RT - split) * RT + rt)
                        else:
                            keys.add(slot - split * cd(dr[b] * H, BM))
                    assert len(keys) == 1, ("splits disagree on the key", keys)
                    key = keys.pop()
                    assert 0 <= key < T, ("key outside the counters", key, T)
                    assert key not in fused_keys, ("key shared by two row tiles", key)
                    fused_keys[key] = (b, rt)
                    # The combine: each split's CTA merges rows split, split + sp, ...
                    merged = []
                    for kb, ke, split, _, slot, x in segl:
                        it = (b, rt, split, kb, ke, 0, sp, slot)
                        if G:
                            want = combine_slots(summary, it, x, sstart)
                        else:
                            row_tiles = cd(dr[b] * H, BM)
                            want = [slot - split * row_tiles + j * row_tiles for j in range(sp)]
                        assert want == [s[4] for s in segl], (want, segl)
                        merged += list(range(split, BM, sp))
                    assert sorted(merged) == list(range(BM))
    if "warp" in res:
        assert res["warp"] == res["kernel"], "the two plan paths differ"
    return res["kernel"][0]


rnd = random.Random(1); bad = 0; stream_used = 0; n_cases = 6000
for it in range(n_cases):
    batch = rnd.choice([rnd.randint(1, 32), rnd.randint(1, 32), rnd.randint(33, 200)])
    H = rnd.choice([1, 2, 8, 16, 128]); T = rnd.choice([132, 264, 16, 1, 3])
    pre = [rnd.choice([0, 1, 31, 32, 33, 4096, 70000, rnd.randint(0, 100000)]) for _ in range(batch)]
    if rnd.random() < 0.5:  # uniform draft counts: the stream plan's case
        n = rnd.choice([1, 4, 16, 64]); dr = [n] * batch
    else:
        dr = [rnd.choice([0, 0, 1, 2, 7, 64, rnd.randint(0, 64)]) for _ in range(batch)]
    if rnd.random() < 0.3:
        k = rnd.randint(0, batch); dr[k:] = [0] * (batch - k)
    if rnd.random() < 0.2:  # a run of padding requests in the middle
        a = rnd.randint(0, batch); b = rnd.randint(a, batch); dr[a:b] = [0] * (b - a)
    if max(dr) == 0: dr[0] = 1
    minc = rnd.choice([1, 2, 4])
    try:
        summary = check(batch, pre, dr, H, T, minc, rnd.random() < 0.9)
        stream_used += summary[1] > 0
    except AssertionError as e:
        bad += 1; print("FAIL", batch, pre, dr, H, T, minc, e); break
print("cases", n_cases, "stream plan chosen", stream_used, "blocks of 32 without a segment", EMPTY_BLOCKS[0])

# Longest work per CTA, chunk plan vs stream plan (in 32-token tiles), T = 132.
def longest_chunk(batch, pre, dr, H, T, minc):
    sh = shapes(batch, pre, dr, H, batch); c = chunk_of(sh, T, minc)
    sp = [cd(t, c) if t > 0 else 0 for *_, t in sh]
    items = sum(r * s for (_, _, r, _), s in zip(sh, sp))
    return cd(items, T) * max(cd(t, s) for (*_, t), s in zip(sh, sp) if s), sh, items
for name, batch, pre_f, n, H in (("B=32 L=64K N=4 H=8", 32, lambda i: 65536, 4, 8),
                                 ("B=8 L=64K N=4 H=16", 8, lambda i: 65536, 4, 16),
                                 ("B=32 L=1K..64K N=4 H=8", 32, lambda i: 1024 + i * 2016, 4, 8),
                                 ("B=64 L=1K..64K N=16 H=8", 64, lambda i: 1024 + i * 1008, 16, 8)):
    pre = [pre_f(i) for i in range(batch)]; dr = [n] * batch
    lc, sh, items = longest_chunk(batch, pre, dr, H, 132, 2)
    G = stream_groups(sh, 132, 2, items, lc // cd(items, 132), True)
    L = sum(t for *_, t in sh)
    print(f"{name}: chunk plan {items} items, longest x waves {lc} tiles; "
          f"stream plan {G} ranges x {sh[0][2]} row tiles, longest {cd(L, G) if G else '-'} tiles")
print("mismatches", bad)
import sys
sys.exit(1 if bad else 0)
