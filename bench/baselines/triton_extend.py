#!/usr/bin/env python3
"""Triton baseline for MLA verify attention: an SGLang-style "extend attention" path.

This is our OWN Triton implementation (no code copied from SGLang) of the approach
SGLang's extend-attention kernel takes for the speculative-decoding verify step, used
as the baseline that mlaverify's CUDA kernel is benchmarked against.

Geometry (DeepSeek-V3 / Kimi K2 MLA, absorbed): every KV token is one latent row of
576 bf16 values = 512 "value" dims (also the first 512 key dims) + 64 rope dims.
Request b has P committed prefix tokens followed by N <= 64 draft tokens in its KV
(L = P + N).  Draft row i sees the whole prefix plus itself and its ancestors in the
draft tree (parents[i] in {-1, 0..i-1}); that set is one int64 bit word per row.

Kernel design (the point of the baseline): one program per (request, head, block of
16 draft rows).  Each program walks the whole PREFIX serially in BLOCK_N-token blocks
with an online softmax (fp32 running max/sum, [16, 512] fp32 accumulator), loading
KV rows through a per-token index (kv_index = page_table -> flat pool row, as SGLang's
req_to_token map), then walks the N draft ("extend") tokens with the tree mask.
Heads are independent programs, so the prefix is re-read once per head.

Usage:
  python3 bench/baselines/triton_extend.py --suite anchor --out triton.json
  python3 bench/baselines/triton_extend.py --shapes 8,16384,16,8,64,tree 1,4096,16,8
Shapes are B,L,N,H[,page_size[,mask]] with L = prefix length, page_size default 64,
mask in {chain, tree} (default tree).  Every shape is checked against a float32 torch
reference on sampled rows; exit 0 only if all pass (rel_err <= 1e-2), 1 otherwise,
2 if torch/triton/CUDA is missing.  --check samples 256 rows instead of 64.
"""
import argparse
import json
import math
import random
import statistics
import sys

try:
    import torch
    import triton
    import triton.language as tl
except Exception as exc:  # pragma: no cover - environment problem, not a bug
    print(f"triton_extend: cannot import torch/triton ({exc!r}); need PyTorch + Triton + CUDA",
          file=sys.stderr)
    sys.exit(2)

D_QK, D_V, D_R = 576, 512, 64
BLOCK_M = 16  # draft rows per program (rows >= N are masked)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# (BLOCK_N, num_warps, num_stages) candidates, preferred first; ones that do not fit are dropped.
CONFIGS = [(64, 8, 2), (64, 8, 1), (64, 4, 1), (32, 4, 2), (32, 8, 2), (32, 4, 1), (16, 4, 1)]
ANCHOR = [(1, 4096, 16, 8), (1, 65536, 16, 8), (8, 16384, 16, 8), (8, 65536, 4, 16),
          (32, 65536, 4, 8), (8, 65536, 16, 16), (8, 16384, 16, 128)]


@triton.jit
def _softmax_update(qk, v, m_i, l_i, acc):
    """One online-softmax step (log2 domain).  qk: [M, N] scaled scores, -inf where masked."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Guard rows that have seen nothing yet (all -inf): avoid (-inf) - (-inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)  # [M, BN] @ [BN, 512], fp32 accumulate
    return m_new, l_i, acc


@triton.jit
def _extend_attn_kernel(Q, KV, KV_INDEX, VIS, P_ARR, N_ARR, Q_OFF, KV_OFF, OUT, LSE,
                        qk_scale,  # softmax scale * log2(e)
                        stride_qt, stride_qh, stride_kv, stride_ot, stride_oh, stride_lt, stride_lh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        D_V: tl.constexpr, D_R: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    P = tl.load(P_ARR + b)                      # prefix length of this request
    N = tl.load(N_ARR + b)                      # draft count of this request
    if mblk * BLOCK_M >= N:                     # row block entirely past this request's drafts
        return
    q_off = tl.load(Q_OFF + b).to(tl.int64)     # first q/out row of this request
    kv_off = tl.load(KV_OFF + b).to(tl.int64)   # first kv_index entry of this request

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < N
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_R)
    rows = q_off + offs_m                       # int64 global draft-row ids

    # q rows: [BLOCK_M, 512] + [BLOCK_M, 64]; two dots per KV block, no padding to 1024.
    q_base = Q + rows[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_base + offs_v[None, :], mask=m_mask[:, None], other=0.0)
    q_pe = tl.load(q_base + D_V + offs_r[None, :], mask=m_mask[:, None], other=0.0)
    vis = tl.load(VIS + rows, mask=m_mask, other=0)  # int64 ancestor bit words

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)

    # ---- prefix: every row sees every token; walked serially, re-read per head ----
    for start in range(0, P, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < P
        idx = tl.load(KV_INDEX + kv_off + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_base = KV + idx[:, None] * stride_kv     # int64: pool can exceed 2^31 elements
        k_nope = tl.load(kv_base + offs_v[None, :], mask=n_mask[:, None], other=0.0)
        k_pe = tl.load(kv_base + D_V + offs_r[None, :], mask=n_mask[:, None], other=0.0)
        qk = tl.dot(q_nope, tl.trans(k_nope))
        qk = tl.dot(q_pe, tl.trans(k_pe), qk)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_update(qk, k_nope, m_i, l_i, acc)

    # ---- extend: the N draft tokens at positions P..P+N-1, tree mask from bit words ----
    for start in range(0, N, BLOCK_N):
        offs_a = start + tl.arange(0, BLOCK_N)
        a_mask = offs_a < N
        idx = tl.load(KV_INDEX + kv_off + P + offs_a, mask=a_mask, other=0).to(tl.int64)
        kv_base = KV + idx[:, None] * stride_kv
        k_nope = tl.load(kv_base + offs_v[None, :], mask=a_mask[:, None], other=0.0)
        k_pe = tl.load(kv_base + D_V + offs_r[None, :], mask=a_mask[:, None], other=0.0)
        qk = tl.dot(q_nope, tl.trans(k_nope))
        qk = tl.dot(q_pe, tl.trans(k_pe), qk)
        shift = tl.where(a_mask, offs_a, 0).to(tl.int64)  # keep shift < 64
        bit = (vis[:, None] >> shift[None, :]) & 1
        visible = (bit != 0) & a_mask[None, :] & m_mask[:, None]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_update(qk, k_nope, m_i, l_i, acc)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptr = OUT + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_mask[:, None])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # log2 domain -> natural log
    tl.store(LSE + rows * stride_lt + h * stride_lh, lse, mask=m_mask)


def launch(cfg, d):
    """Launch the kernel for prepared inputs d with config (BLOCK_N, num_warps, num_stages)."""
    block_n, warps, stages = cfg
    grid = (d["B"], d["H"], triton.cdiv(d["max_n"], BLOCK_M))
    _extend_attn_kernel[grid](
        d["q"], d["pool"], d["kv_index"], d["vis"], d["p_arr"], d["n_arr"], d["q_off"],
        d["kv_off"], d["out"], d["lse"], d["scale"] * LOG2E,
        d["q"].stride(0), d["q"].stride(1), d["pool"].stride(0),
        d["out"].stride(0), d["out"].stride(1), d["lse"].stride(0), d["lse"].stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, D_V=D_V, D_R=D_R,
        num_warps=warps, num_stages=stages)


def make_parents(n, mask, rng):
    if mask == "chain":
        return [i - 1 for i in range(n)]
    # Random tree: parent i-1 half the time (deep-ish), else uniform in [-1, i-1].
    return [i - 1 if rng.random() < 0.5 else rng.randint(-1, i - 1) for i in range(n)]


def vis_words(parents):
    """Unsigned bit words: bit a set iff draft a is row i itself or an ancestor of i."""
    vis = []
    for i, par in enumerate(parents):
        vis.append((1 << i) | (vis[par] if par >= 0 else 0))
    return vis


def build_inputs(Ps, Ns, H, page_size, mask, seed, scale):
    """Random q / paged KV pool / kv_index / visibility words on the GPU; per-request P and N."""
    assert len(Ps) == len(Ns) and all(1 <= n <= 64 for n in Ns), "draft counts must be in 1..64"
    dev = "cuda"
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = len(Ps)
    Ls = [p + n for p, n in zip(Ps, Ns)]
    pages_per = [triton.cdiv(l, page_size) for l in Ls]
    num_pages = sum(pages_per)
    perm = torch.randperm(num_pages, device=dev, dtype=torch.int64)  # non-trivial page mapping
    pool = torch.empty(num_pages * page_size, D_QK, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
    kv_chunks, q_off, kv_off, vis_all, vis_py = [], [], [], [], []
    page_pos, q_rows, kv_rows = 0, 0, 0
    for b in range(B):
        page_table = perm[page_pos:page_pos + pages_per[b]]  # request b's page ids
        page_pos += pages_per[b]
        j = torch.arange(Ls[b], device=dev, dtype=torch.int64)
        kv_chunks.append((page_table[j // page_size] * page_size + j % page_size).to(torch.int32))
        q_off.append(q_rows)
        kv_off.append(kv_rows)
        q_rows += Ns[b]
        kv_rows += Ls[b]
        words = vis_words(make_parents(Ns[b], mask, rng))
        vis_py.append(words)
        vis_all += [w - (1 << 64) if w >= (1 << 63) else w for w in words]  # as signed int64
    q = torch.empty(q_rows, H, D_QK, device=dev, dtype=torch.bfloat16).uniform_(-2, 2)
    i32 = dict(device=dev, dtype=torch.int32)
    return dict(
        B=B, H=H, max_n=max(Ns), Ps=Ps, Ns=Ns, Ls=Ls, q=q, pool=pool, scale=scale,
        kv_index=torch.cat(kv_chunks), vis=torch.tensor(vis_all, device=dev, dtype=torch.int64),
        vis_py=vis_py, p_arr=torch.tensor(Ps, **i32), n_arr=torch.tensor(Ns, **i32),
        q_off=torch.tensor(q_off, **i32), kv_off=torch.tensor(kv_off, device=dev, dtype=torch.int64),
        q_off_py=q_off, kv_off_py=kv_off,
        out=torch.empty(q_rows, H, D_V, device=dev, dtype=torch.bfloat16),
        lse=torch.empty(q_rows, H, device=dev, dtype=torch.float32))


def check(d, n_samples, seed):
    """float32 torch reference on sampled (request, draft, head) rows -> (rel_err, lse_max_abs_err)."""
    rng = random.Random(seed + 1)
    B, H = d["B"], d["H"]
    samples = {(0, 0, 0), (B - 1, d["Ns"][B - 1] - 1, H - 1)}
    total = sum(d["Ns"]) * H
    while len(samples) < min(n_samples, total):
        b = rng.randrange(B)
        samples.add((b, rng.randrange(d["Ns"][b]), rng.randrange(H)))
    if torch.isnan(d["out"]).any() or torch.isnan(d["lse"]).any():
        return float("nan"), float("nan")
    got_o, ref_o, got_l, ref_l = [], [], [], []
    for b in sorted({s[0] for s in samples}):
        rows = sorted(s for s in samples if s[0] == b)
        P, N, L = d["Ps"][b], d["Ns"][b], d["Ls"][b]
        idx = d["kv_index"][d["kv_off_py"][b]:d["kv_off_py"][b] + L].long()
        kv = d["pool"][idx].float()                                   # [L, 576]
        qrow = [d["q_off_py"][b] + i for _, i, _ in rows]
        heads = [h for _, _, h in rows]
        qs = d["q"][qrow, heads].float()                              # [S, 576]
        s = (qs @ kv.T) * d["scale"]                                  # [S, L]
        draft_vis = [[bool((d["vis_py"][b][i] >> a) & 1) for a in range(N)] for _, i, _ in rows]
        vis = torch.ones(len(rows), L, dtype=torch.bool, device=s.device)  # prefix: all visible
        vis[:, P:] = torch.tensor(draft_vis, dtype=torch.bool).to(s.device)
        s = s.masked_fill(~vis, float("-inf"))
        ref_l.append(torch.logsumexp(s, dim=1))
        ref_o.append(torch.softmax(s, dim=1) @ kv[:, :D_V])
        got_o.append(d["out"][qrow, heads].float())
        got_l.append(d["lse"][qrow, heads].float())
        del kv, s
    go, ro = torch.cat(got_o), torch.cat(ref_o)
    gl, rl = torch.cat(got_l), torch.cat(ref_l)
    if torch.isnan(go).any() or torch.isnan(gl).any():
        return float("nan"), float("nan")
    rel = (torch.linalg.vector_norm(go - ro) / torch.linalg.vector_norm(ro)).item()
    return rel, (gl - rl).abs().max().item()


def time_runs(cfg, d, reps, flush):
    """Per-run milliseconds: L2 flushed (outside the timed region) before every run."""
    evs = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(cfg, d)
        end.record()
        evs.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


def pick_config(d, flush, tune):
    """Drop configs that do not fit (OutOfResources); with tune, keep the fastest of the rest."""
    best, best_t, last_exc = None, float("inf"), None
    for cfg in CONFIGS:
        try:
            launch(cfg, d)
            torch.cuda.synchronize()
        except Exception as exc:  # OutOfResources (smem/regs) or a compile failure
            last_exc = exc
            print(f"  config {cfg} unusable: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        if not tune:
            return cfg
        t = min(time_runs(cfg, d, 2, flush))
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"no kernel configuration works; last error: {last_exc!r}")
    return best


def run_shape(B, L, N, H, page_size, mask, args, flush, seed):
    d = build_inputs([L] * B, [N] * B, H, page_size, mask, seed, args.scale)
    cfg = pick_config(d, flush, not args.no_tune)
    d["out"].fill_(float("nan"))  # make any unwritten output visible to the check
    d["lse"].fill_(float("nan"))
    launch(cfg, d)
    torch.cuda.synchronize()
    rel, lse_err = check(d, 256 if args.check else 64, seed)
    warm = time_runs(cfg, d, 3, flush)
    reps = args.reps if max(warm) <= 50.0 else min(args.reps, 10)
    t_us = statistics.median(time_runs(cfg, d, reps, flush)) * 1e3
    t_s = t_us * 1e-6
    nbytes = B * (L + N) * 1152
    flops = B * N * H * (L + N) * 2176
    del d
    torch.cuda.empty_cache()
    return {"batch": B, "prefix_len": L, "draft_len": N, "heads": H, "page_size": page_size,
            "mask": mask, "time_us": round(t_us, 2), "reps": reps,
            "tbps": nbytes / t_s / 1e12, "tflops": flops / t_s / 1e12,
            "rel_err": rel, "lse_max_abs_err": lse_err,
            "config": {"block_m": BLOCK_M, "block_n": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}}


def parse_shape(text):
    parts = text.split(",")
    if not 4 <= len(parts) <= 6:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: want B,L,N,H[,page_size[,mask]]")
    B, L, N, H = (int(x) for x in parts[:4])
    page_size = int(parts[4]) if len(parts) > 4 else 64
    mask = parts[5] if len(parts) > 5 else "tree"
    if mask not in ("chain", "tree") or not 1 <= N <= 64 or min(B, H, page_size) < 1 or L < 0:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}")
    return (B, L, N, H, page_size, mask)


def fmt(x, spec):
    return "nan" if x != x else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", type=parse_shape, default=[], help="B,L,N,H[,page_size[,mask]]")
    ap.add_argument("--suite", choices=["anchor"], help="anchor: 7 shapes x {chain,tree} x page {1,64}")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions (10 for runs > 50 ms)")
    ap.add_argument("--out", help="write JSON results here (default: stdout only)")
    ap.add_argument("--check", action="store_true", help="sample 256 rows for the check instead of 64")
    ap.add_argument("--scale", type=float, default=1.0 / math.sqrt(192.0), help="softmax scale")
    ap.add_argument("--no-tune", action="store_true", help="use the first config that fits")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("triton_extend: no CUDA device visible; this benchmark needs an NVIDIA GPU", file=sys.stderr)
        sys.exit(2)
    shapes = list(args.shapes)
    if args.suite == "anchor":
        shapes += [(B, L, N, H, ps, m) for (B, L, N, H) in ANCHOR for m in ("chain", "tree") for ps in (1, 64)]
    if not shapes:
        shapes = [(1, 4096, 16, 8, 64, "tree")]
    torch.set_float32_matmul_precision("highest")  # the reference must be true fp32 (no TF32)
    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda", dtype=torch.int32)
    rows = []
    for k, (B, L, N, H, ps, mask) in enumerate(shapes):
        r = run_shape(B, L, N, H, ps, mask, args, flush, args.seed + k)
        rows.append(r)
        print(f"B={B} L={L} N={N} H={H} page={ps} {mask}: {r['time_us']:.1f} us ({r['reps']} reps) "
              f"{r['tbps']:.3f} TB/s {r['tflops']:.2f} TFLOP/s rel_err={fmt(r['rel_err'], '.2e')} "
              f"lse_err={fmt(r['lse_max_abs_err'], '.2e')} cfg={tuple(r['config'].values())}", flush=True)
    hdr = f"{'B':>3} {'L':>6} {'N':>3} {'H':>4} {'pg':>3} {'mask':>5} {'time_us':>10} {'TB/s':>7} " \
          f"{'TFLOP/s':>8} {'rel_err':>9} {'lse_err':>9}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(f"{r['batch']:>3} {r['prefix_len']:>6} {r['draft_len']:>3} {r['heads']:>4} {r['page_size']:>3} "
              f"{r['mask']:>5} {r['time_us']:>10.1f} {r['tbps']:>7.3f} {r['tflops']:>8.2f} "
              f"{fmt(r['rel_err'], '9.2e')} {fmt(r['lse_max_abs_err'], '9.2e')}")
    result = {"impl": "triton_extend", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:  # NaN is written as the JSON extension token NaN
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    failed = [r for r in rows if not (r["rel_err"] <= 1e-2)]  # NaN fails this test too
    for r in failed:
        print(f"FAILED: B={r['batch']} L={r['prefix_len']} N={r['draft_len']} H={r['heads']} "
              f"page={r['page_size']} {r['mask']}: rel_err={r['rel_err']}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
