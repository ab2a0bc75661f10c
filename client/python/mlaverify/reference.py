"""A NumPy reference of the verify math (docs/wire-contract.md), for checking
the server's answers: for draft i, head h, the visible keys are the prefix
rows 0..P-1 and the drafts on i's root path (i and its ancestors);
s = scale * q[i,h,:576] . kv[j,:576], out[i,h] = sum_j softmax(s)_j kv[j,:512],
lse[i,h] = ln sum_j exp(s_j)."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from mlaverify.tensors import float32_from_bf16

VALUE_DIM = 512
FP8_GROUP = 128
FP8_MAX = 448.0


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest e4m3 value (ties to even),
    saturating at +-448: what the server's FloatToE4m3 stores, as float32."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    _, e = np.frexp(a)                       # a = m * 2^e, m in [0.5, 1)
    exponent = np.maximum(e - 1, -6)         # below 2^-6: subnormal steps of 2^-9
    step = np.ldexp(1.0, exponent - 3)       # 3 mantissa bits
    rounded = np.minimum(np.round(a / step) * step, FP8_MAX)   # np.round: half to even
    return (np.sign(x) * rounded).astype(np.float32)


def fp8_stored(rows: np.ndarray) -> np.ndarray:
    """[..., 576] bf16 bits (uint16) or float32 -> the float32 values an fp8
    pool (--kv-dtype fp8) stands for: per row and 128-value group of the first
    512 columns, scale = amax / 448 in float32, value = e4m3(x / scale) *
    scale; the 64 rope columns unchanged (common/kv_dtype.h)."""
    rows = np.asarray(rows)
    f = (float32_from_bf16(rows) if rows.dtype == np.uint16 else rows).astype(np.float32)
    out = f.copy()
    groups = f[..., :VALUE_DIM].reshape(f.shape[:-1] + (VALUE_DIM // FP8_GROUP, FP8_GROUP))
    scale = (np.abs(groups).max(axis=-1, keepdims=True) / np.float32(FP8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.where(scale > 0, e4m3_round((groups / safe).astype(np.float32)), np.float32(0.0))
    out[..., :VALUE_DIM] = (codes * scale).astype(np.float32).reshape(f.shape[:-1] + (VALUE_DIM,))
    return out


def ancestors_mask(parents: Sequence[int]) -> np.ndarray:
    """[N, N] bool: mask[i, a] when draft a is i or an ancestor of i."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        a = i
        while a != -1:
            mask[i, a] = True
            a = parents[a]
    return mask


def verify_reference(prefix_kv: np.ndarray, q: np.ndarray, draft_kv: np.ndarray,
                     parents: Sequence[int], scale: float,
                     kv_dtype: str = "bf16") -> Tuple[np.ndarray, np.ndarray]:
    """prefix_kv [P, 576], q [N, H, 576], draft_kv [N, 576]: bf16 bits
    (uint16) or float32. kv_dtype: the server's (ServerInfo.kv_dtype); with
    "fp8" the rows are taken as an fp8 pool stores them (fp8_stored). Returns
    out float32 [N, H, 512], lse float32 [N, H], computed in float64."""
    def as_float(x):
        x = np.asarray(x)
        return (float32_from_bf16(x) if x.dtype == np.uint16 else x).astype(np.float64)

    if kv_dtype not in ("bf16", "fp8", ""):
        raise ValueError(f"kv_dtype {kv_dtype!r}: bf16 or fp8")
    stored = fp8_stored if kv_dtype == "fp8" else as_float
    prefix, qf, drafts = stored(prefix_kv).astype(np.float64), as_float(q), \
        stored(draft_kv).astype(np.float64)
    n = qf.shape[0]
    keys = np.concatenate([prefix, drafts], axis=0)                  # [P+N, 576]
    scores = scale * np.einsum("nhd,kd->nhk", qf, keys)               # [N, H, P+N]
    visible = np.concatenate([np.ones((n, prefix.shape[0]), dtype=bool), ancestors_mask(parents)],
                             axis=1)                                  # [N, P+N]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    top = scores.max(axis=2, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=2, keepdims=True)
    out = np.einsum("nhk,kd->nhd", weights / total, keys[:, :VALUE_DIM])
    lse = (top + np.log(total))[:, :, 0]
    return out.astype(np.float32), lse.astype(np.float32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere gives NaN)."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))
