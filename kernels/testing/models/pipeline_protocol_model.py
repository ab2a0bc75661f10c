#!/usr/bin/env python3
"""Hand-written host model of PipelinedAttentionKernel's hand-over protocol
(kernels/verify_pipelined_kernel.cuh), warp granularity, with and without the
page-id ring: random warp interleavings over 0..13 tiles, checking
named-barrier arrival counts, deadlocks, shared-memory read/write order
(vector clocks) and cp.async group completion. It mirrors the kernel by hand:
update it with any change to the barriers, stages or groups.
The score pair splits keys (v22): per tile one pair barrier (the
reduction) and, on a random third of the tiles (the same choice in both warps,
as the reduction's result is), the tile maxima written, a second pair barrier
and the partner's read; at the end key half 1 hands its row sums to key half
0, which alone writes the rows' 1 / l. `--plant max-unsynced` drops the barrier
between writing the tile maxima and reading the partner's: it must report bad
runs. `--plant kv-full-before-offset` has the PV warps arrive KV_FULL(t+2)
before their BAR_SCORE_MMA_DONE sync (v23's early arrival one step too
early): S(t+2) can then arrive at MMA_DONE twice in one phase.
Run: python3 kernels/testing/models/pipeline_protocol_model.py (~10 s);
prints "bad runs: 0" and exits 0 when clean. `--plant staging-before-final`
runs it with a fault planted on purpose (the epilogue stages O before
BAR_FINAL, over tiles other warps may still read): it must report bad runs.
`--plant published-early` reads the partner's published references (the
page-ring instances' per-half references) before the tile's BAR_SCORE /
KV_FULL sync instead of after it: tile t - 1's value is then not guaranteed
visible.
`--plant p-empty-late` moves the score warps' P_EMPTY wait from the top of
the tile to just before P(t) is written, for every tile: then a score warp
can arrive at BAR_SCORE_MMA_DONE (v15.1) twice before a lagging PV warp
has taken the first arrival. Only the slow-warp schedules find it (half
the runs keep one warp at 2 % of its share of the scheduler); CTest runs
both plants and expects them to fail.

`--fp8`: the fp8 instances. Their loads land raw fp8 rows, which the warp
that loaded them converts in place (ConvertFp8Row) before the tile may be
read: the score warps convert every prologue tile after a wait for all
their groups, before the tile loop; the PV warps convert tile t+3 at the
end of iteration t, after its commit and a wait that leaves one group
pending. A conversion is a synchronous write of the warp's part of the
stage: its tile must have landed, no read of the stage's earlier tile may
be unordered with it, and every read of the tile must come after it.
`--fp8 --plant fp8-convert-late` converts tile t+2 after arriving KV_FULL(t+2)
instead: the score warps may then read it unconverted (CTest expects the
fault).

The epilogue (v9.2): after BAR_FINAL each PV warp writes its O slice into its
own piece of the KV stages (StoreOutputSliceStaged), STAGING bytes per warp
from the start of stage 0; modelled as synchronous writes of those stages,
which must come after every read of them and after every cp.async into them.
"""
# Host-side model of the pipelined kernel's hand-over protocol (warp granularity).
import random, sys

PLANT = sys.argv[sys.argv.index('--plant') + 1] if '--plant' in sys.argv else None
FP8 = '--fp8' in sys.argv
# The PV warps arrive KV_FULL(t+2) during their MMAs of tile t (v23: three
# quarters through them on the register page path, halfway in the page-ring
# instance, before them in the fused page-ring one; all order the same
# against the other warps, PV(t) reads only stage t's tile either way),
# after the phase-offset sync where there is one.
# Per-half exponent references (v26c), in the page-ring instances: the score
# pair drops its per-tile barrier; each score warp publishes its references
# (a relaxed word, read by the partner at the top of the next tiles) and
# writes the tile's references and dirty flag beside P.

def half_refs_in(ring):
    """Whether this instance's score pair keeps per-half references."""
    return ring

KS = 2  # score warps per row group (Shape::KEY_HALVES)

def run(nt, ring, seed):
    rnd = random.Random(seed)
    SW = 2 * KS; PW = SW; NS = 5; QS = NS - 2
    ALL = SW + PW
    BAR_SCORE, BAR_PAIR, BAR_P_FULL, BAR_P_EMPTY, BAR_FINAL, BAR_KV_FULL, BAR_SCORE_MMA_DONE = 1, 2, 4, 6, 8, 9, 11
    W = SW + PW
    vc = [[0]*W for _ in range(W)]
    errs = []
    stage_writes = {s: [] for s in range(NS)}   # list of dict(tile, issuer, t_issue, done_vc)
    reads = {}  # resource -> list of (warp, time)
    res_write = {}  # resource -> (writer, time, tag)
    openg = [[] for _ in range(W)]
    groups = [[] for _ in range(W)]
    def tick(w): vc[w][w] += 1; return vc[w][w]
    def hb(ev_w, ev_t, w): return vc[w][ev_w] >= ev_t
    def write_res(w, r, tag):
        t = tick(w)
        for (x, tr) in reads.get(r, []):
            if x != w and not hb(x, tr, w): errs.append(f"WAR {r} by w{w} tag {tag} vs read w{x}")
        reads[r] = []
        res_write[r] = (w, t, tag)
    # A relaxed shared word (the published references): no ordering is
    # required for the kernel to be correct, except that the partner's value
    # of tile t - 1 is visible at tile t (what the dirty flag's argument uses).
    pub = {}  # warp -> {tile: (writer time)}
    def publish(w, t):
        pub.setdefault(w, {})[t] = tick(w)
    def read_published(w, partner, t):
        tick(w)
        if t >= 1:
            wt = pub.get(partner, {}).get(t - 1)
            if wt is None or not hb(partner, wt, w):
                errs.append(f"published reference of w{partner} at tile {t - 1} not visible to w{w} at {t}")
    def read_res(w, r, tag):
        t = tick(w)
        if r not in res_write: errs.append(f"read unwritten {r}"); return
        ww, wt, wtag = res_write[r]
        if wtag != tag: errs.append(f"read {r} want {tag} got {wtag} by w{w}")
        elif ww != w and not hb(ww, wt, w): errs.append(f"RAW {r} tag {tag} w{w}")
        reads.setdefault(r, []).append((w, t))
    # async stage writes
    def issue(w, stage, tile, part):
        t = tick(w)
        r = ('stage', stage)
        for (x, tr) in reads.get(r, []):
            if x != w and not hb(x, tr, w): errs.append(f"WAR stage {stage} tile {tile} by w{w} vs read w{x}")
        for rec in qrecs.get(stage, []):
            if rec['done'] is None: errs.append("WAW over Q in flight")
        for (x, tr) in qreads.get(stage, []):
            if x != w and not hb(x, tr, w): errs.append(f"WAR Q stage {stage} by w{w} vs Q read w{x}")
        for rec in stage_writes[stage]:
            if rec['done'] is None and rec['part'] == part: errs.append(f"WAW stage {stage}: tile {tile} while tile {rec['tile']} in flight")
        rec = {'tile': tile, 'issuer': w, 'done': None, 'part': part, 'converted': not FP8}
        stage_writes[stage] = [x for x in stage_writes[stage] if x['part'] != part] + [rec]
        openg[w].append(rec)
    def commit(w): groups[w].append(openg[w]); openg[w] = []
    def wait(w, n):
        t = tick(w)
        k = len(groups[w]) - n
        for g in groups[w][:max(k, 0)]:
            for rec in g:
                if rec['done'] is None: rec['done'] = (w, t)
        groups[w] = groups[w][max(k, 0):]
    def read_stage(w, stage, tile, who):
        t = tick(w)
        recs = stage_writes[stage]
        if len(recs) != 4: errs.append(f"{who} read stage {stage} with {len(recs)} parts"); return
        for rec in recs:
          if rec['tile'] != tile: errs.append(f"{who} w{w} read stage {stage} want {tile} got {rec['tile']}")
          elif rec['done'] is None: errs.append(f"{who} w{w} read stage {stage} tile {tile} in flight")
          elif not hb(rec['done'][0], rec['done'][1], w): errs.append(f"{who} w{w} read tile {tile} not HB")
          elif not rec['converted']: errs.append(f"{who} w{w} read tile {tile} before its fp8 conversion")
        reads.setdefault(('stage', stage), []).append((w, t))
    # fp8: the loading warp converts its part of a landed tile in place
    def convert(w, stage, tile, part):
        t = tick(w)
        for (x, tr) in reads.get(('stage', stage), []):
            if x != w and not hb(x, tr, w): errs.append(f"convert WAR stage {stage} by w{w} vs read w{x}")
        mine = [rec for rec in stage_writes[stage] if rec['part'] == part]
        if len(mine) != 1 or mine[0]['tile'] != tile or mine[0]['issuer'] != w:
            errs.append(f"w{w} converts stage {stage} tile {tile}: not its load"); return
        rec = mine[0]
        if rec['done'] is None or rec['done'][0] != w:
            errs.append(f"w{w} converts tile {tile} before its cp.async completed"); return
        rec['converted'] = True
        rec['done'] = (w, t)  # readers must see the conversion, not just the landing
    # the epilogue's staging: a synchronous write of every stage its bytes touch
    def write_stage_sync(w, stage):
        t = tick(w)
        for (x, tr) in reads.get(('stage', stage), []):
            if x != w and not hb(x, tr, w): errs.append(f"staging WAR stage {stage} by w{w} vs read w{x}")
        for (x, tr) in qreads.get(stage, []):
            if x != w and not hb(x, tr, w): errs.append(f"staging WAR Q stage {stage} by w{w} vs Q read w{x}")
        for rec in stage_writes[stage] + qrecs.get(stage, []):
            if rec['done'] is None or not hb(rec['done'][0], rec['done'][1], w):
                errs.append(f"staging WAW stage {stage} by w{w}: tile {rec['tile']} not complete")
    STAGE_BYTES = 16 * 1152
    STAGING = 32 * (128 * 2 + 16)  # per PV warp: 32 rows x (its 128 columns + 16 B pad)
    def staged_store(w):
        v = w - SW
        first, last = v * STAGING, (v + 1) * STAGING - 1
        for s in range(first // STAGE_BYTES, last // STAGE_BYTES + 1):
            assert s < NS, "the staging fits the stages"
            write_stage_sync(w, s)
    # barriers
    bars = {}
    def bar_op(w, bid, cnt, is_sync):
        b = bars.setdefault(bid, {'n': 0, 'cnt': cnt, 'vcs': [], 'wait': [], 'who': set()})
        if b['n'] == 0: b['cnt'] = cnt
        if b['cnt'] != cnt: errs.append(f"bar {bid} count mismatch")
        if w in b['who']: errs.append(f"bar {bid}: w{w} twice in one phase")
        b['who'].add(w); tick(w)
        b['n'] += 1; b['vcs'].append(list(vc[w]))
        if is_sync: b['wait'].append(w)
        if b['n'] == b['cnt']:
            j = [max(v[i] for v in b['vcs']) for i in range(W)]
            for x in b['wait']:
                vc[x] = [max(a, c) for a, c in zip(vc[x], j)]; blocked.discard(x)
            bars[bid] = {'n': 0, 'cnt': cnt, 'vcs': [], 'wait': [], 'who': set()}
            return False
        return is_sync  # blocked?
    blocked = set()
    def score(w):
        rg, ks = w // KS, w % KS
        loader = w < 4
        # Q into stages QS, QS+1
        for s in (QS, QS + 1):
            rec = {'tile': 'Q', 'issuer': w, 'done': None, 'part': ('Q', w)}
            openg[w].append(rec); qrecs.setdefault(s, []).append(rec)
        commit(w)
        for t in range(QS):
            if loader and t < nt: issue(w, t, t, w)
            commit(w)
        wait(w, QS)
        yield ('sync', BAR_SCORE, SW)
        for s in (QS, QS + 1):
            for rec in qrecs[s]:
                if rec['done'] is None or not hb(rec['done'][0], rec['done'][1], w): errs.append("Q not visible")
            qreads.setdefault(s, []).append((w, tick(w)))
        yield ('sync', BAR_SCORE, SW)
        for t in range(QS, NS):
            if loader and t < nt: issue(w, t, t, w)
            commit(w)
        if FP8:  # every prologue tile, before the tile loop
            wait(w, 0)
            for t in range(NS):
                if loader and t < nt: convert(w, t, t, w)
        for t in range(nt):
            half = half_refs_in(ring)
            # --plant published-early: the partner's published references read
            # before this tile's BAR_SCORE / KV_FULL: tile t - 1's may not be there.
            if half and PLANT == 'published-early': read_published(w, w ^ 1, t)
            # v15.3: P_EMPTY at the top for the prologue tiles only; the
            # p-empty-late plant drops it there too.
            if t >= 2 and t < NS and PLANT != 'p-empty-late': yield ('sync', BAR_P_EMPTY + (t & 1), ALL)
            if t < NS:
                wait(w, NS - 1 - t); yield ('sync', BAR_SCORE, SW)
            else:
                yield ('sync', BAR_KV_FULL + (t & 1), ALL)
            if half and PLANT != 'published-early': read_published(w, w ^ 1, t)
            read_stage(w, t % NS, t, 'score')
            yield None
            if not ring and t >= 1: yield ('arrive', BAR_SCORE_MMA_DONE, ALL)  # S(t)'s MMAs issued: PV(t-1) may go
            if half:
                # No pair barrier: the references go out as a relaxed word (in
                # the kernel only when they move; here every tile, a superset).
                publish(w, t)
            else:
                # v22: one barrier reduction per tile; on the rare reference
                # change (the same choice in both warps of the pair: it is the
                # reduction's result) the tile maxima go through shared memory.
                yield ('sync', BAR_PAIR + rg, KS)
                if random.Random(seed * 7919 + t * 31 + rg).random() < 0.3:
                    write_res(w, ('max', w), t)
                    if PLANT != 'max-unsynced': yield ('sync', BAR_PAIR + rg, KS)
                    read_res(w, ('max', w ^ 1), t)
            yield None
            if t >= NS or (t >= 2 and PLANT == 'p-empty-late'):
                yield ('sync', BAR_P_EMPTY + (t & 1), ALL)  # late: just before P(t) is written
            write_res(w, ('P', t & 1, w), t)
            # the tile's references and dirty flag, beside P (in the kernel the
            # references only on the two tiles after a move: a subset)
            if half: write_res(w, ('refs', t & 1, w), t)
            yield ('arrive', BAR_P_FULL + (t & 1), ALL)
        # key half 1 hands its row sums to key half 0, which stores the rows' stats
        if ks == 1: write_res(w, ('sum', w), 'final')
        yield ('sync', BAR_PAIR + rg, KS)
        if ks == 0:
            read_res(w, ('sum', w + 1), 'final')
            write_res(w, ('invl', w), 'final')
        yield ('arrive', BAR_FINAL, ALL)
    def pv(w):
        v = w - SW; loader = v < 4
        if ring:
            for i in range(4):
                if loader: write_res(w, ('ring', (NS + i) % 8), NS + i)
            commit(w); wait(w, 0)
        for t in range(nt):
            yield ('sync', BAR_P_FULL + (t & 1), ALL)
            for x in range(SW): read_res(w, ('P', t & 1, x), t)
            if half_refs_in(ring):
                for x in range(SW): read_res(w, ('refs', t & 1, x), t)
            kv_full = t + 2 < nt and t + 2 >= NS
            if kv_full and PLANT == 'kv-full-before-offset':
                wait(w, NS - 4)
                yield ('arrive', BAR_KV_FULL + (t & 1), ALL)
                kv_full = False
            if not ring and t + 1 < nt: yield ('sync', BAR_SCORE_MMA_DONE, ALL)  # phase offset (v15, register page path)
            if kv_full:  # v23: during the MMAs (after the phase-offset sync)
                wait(w, NS - 4)
                yield ('arrive', BAR_KV_FULL + (t & 1), ALL)
                if FP8 and PLANT == 'fp8-convert-late' and loader:
                    convert(w, (t + 2) % NS, t + 2, v)
            read_stage(w, t % NS, t, 'pv')
            yield None
            if t + 2 < nt: yield ('arrive', BAR_P_EMPTY + (t & 1), ALL)
            if t >= 1:
                lt = t + NS - 1
                if loader and lt < nt:
                    if ring: read_res(w, ('ring', lt % 8), lt)
                    issue(w, (t - 1) % NS, lt, v)
                    if ring: write_res(w, ('ring', (lt + 4) % 8), lt + 4)
                commit(w)
                ct = t + 3  # fp8: the tile loaded at the end of iteration t - 1
                if FP8 and PLANT != 'fp8-convert-late' and NS <= ct < nt:
                    wait(w, NS - 4)
                    if loader: convert(w, ct % NS, ct, v)
        # CpAsyncWait<0>: in the kernel for the page ring's last fetches (their
        # own region, synchronous in this model); every KV load into a stage
        # has been waited for before its tile was read.
        wait(w, 0)
        if PLANT == 'staging-before-final':
            staged_store(w)
        yield ('sync', BAR_FINAL, ALL)
        for x in range(SW):
            if x % 2 == 0: read_res(w, ('invl', x), 'final')
        if PLANT != 'staging-before-final':
            staged_store(w)
    qrecs = {}; qreads = {}
    progs = {w: (score(w) if w < SW else pv(w)) for w in range(W)}
    # ring writes are synchronous in this model (cp.async completion approximated by the prologue wait)
    alive = set(range(W))
    # Half the runs have one slow warp, scheduled only 2 % of the times it
    # could be: uniform choice almost never lets a warp fall far behind,
    # and some hazards (a barrier phase reused before a lagging warp reached
    # it) need exactly that.
    slow = rnd.randrange(W) if rnd.random() < 0.5 else -1
    while alive:
        cand = [w for w in alive if w not in blocked]
        if not cand:
            errs.append(f"deadlock nt={nt}"); break
        if slow in cand and len(cand) > 1 and rnd.random() > 0.02:
            cand.remove(slow)
        w = rnd.choice(cand)
        try:
            op = next(progs[w])
        except StopIteration:
            alive.discard(w); continue
        if op is None: continue
        kind, bid, cnt = op
        if bar_op(w, bid, cnt, kind == 'sync'): blocked.add(w)
    for bid, b in bars.items():
        if b['n'] != 0: errs.append(f"bar {bid} left with {b['n']} arrivals")
    return errs

bad = 0
for ring in (False, True):
    for nt in range(0, 14):
        for seed in range(300):
            e = run(nt, ring, seed)
            if e:
                bad += 1
                if bad < 10: print(ring, nt, seed, e[:3])
                if PLANT:  # a planted fault only has to be found once
                    print("bad runs: >= 1 (planted fault found)")
                    sys.exit(1)
print("bad runs:", bad)
sys.exit(1 if bad else 0)
