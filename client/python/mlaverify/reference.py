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
                     parents: Sequence[int], scale: float) -> Tuple[np.ndarray, np.ndarray]:
    """prefix_kv [P, 576], q [N, H, 576], draft_kv [N, 576]: bf16 bits
    (uint16) or float32. Returns out float32 [N, H, 512], lse float32 [N, H],
    computed in float64."""
    def as_float(x):
        x = np.asarray(x)
        return (float32_from_bf16(x) if x.dtype == np.uint16 else x).astype(np.float64)

    prefix, qf, drafts = as_float(prefix_kv), as_float(q), as_float(draft_kv)
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
