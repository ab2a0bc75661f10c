#!/usr/bin/env python3
"""Speculative decoding through an mlaverify server, checked token for token
against plain greedy decoding of the same model.

The model is a small random-weight transformer with DeepSeek-V3's attention
geometry (MLA): low-rank queries (q_a -> RMSNorm -> q_b), low-rank keys and
values (kv_a to a 512-wide latent plus 64 rope dims, the rope key shared by
every head), absorbed queries of 576 = 512 + 64 (W_UK folded into q, W_UV
applied to the 512-wide attention output), RMSNorm, rotary positions. Its
weights come from a NumPy generator with a fixed seed, so every machine
builds the same model.

Per prompt: the prompt runs through the model here (prefill) and its latent
KV of every layer goes to the server by AppendKv. Then per decode step the
draft proposer builds a tree of draft tokens under the last generated token
(by default the target's own greedy continuation with a quarter of its chain
tokens missed, so that drafts are accepted at any depth, 61 layers
included; `--drafter layers`: a draft model of the target's first layers); the tree runs through the
model layer by layer, each layer's attention computed by the server
(Verify: absorbed q [N, H, 576] and the tree's latent rows [N, 576] in,
out [N, H, 512] back); the longest root path whose tokens the model picks
greedily is accepted and committed (Commit), the rest dropped; the model's
pick after the last accepted node is the next token. The reference decodes
the same prompts one token at a time with attention computed here in
float32 over the same bf16-rounded latent rows and queries the server
receives, its output rounded to bf16 as the server's. The tokens must be identical; a difference is allowed only where
the reference's two best logits are within bf16 rounding of each other
(counted and reported).

    build/server/mlaverify-server --backend cpu --layers 4 --heads 8 \\
        --draft-buckets 1 2 4 8 16 --listen 127.0.0.1:50051 --admin-port -1 &
    PYTHONPATH=build/client/python python3 client/python/examples/spec_decode.py \\
        --target 127.0.0.1:50051 --prompts 20 --tokens 32 --json spec.json

Exit status: 0 when the tokens are equal (ties aside), 1 on a divergence,
2 when the run cannot be made (a server of another geometry, a plane the
package lacks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mlaverify import (SharedMemoryRegion, StepItemPlacement, StepRank, VerifyClient, VerifyItem,
                       place_item)
from mlaverify.shm import item_bytes
from mlaverify.steps import SLOT_BYTES

LATENT = 512  # kv_lora_rank: the latent row, also the value width
ROPE = 64     # qk_rope_head_dim: the shared rope key
ROW = LATENT + ROPE  # 576, what the server stores per token and layer
PLANES = ("inline", "system-shm", "cuda-shm", "steps")
# bf16 keeps 8 significant bits. An attention summed in another order (the
# server's kernels against torch here) rounds an occasional output element to
# the neighbouring bf16 value; through the layers that moves the logits a
# little, so two logits closer than one bf16 step of the larger may come out
# in either order: a divergence there is a tie, not an error.
TIE_RTOL = 2.0 ** -8


@dataclass
class ModelConfig:
    """DeepSeek-V3's attention geometry where the server sees it (latent 512 +
    shared rope 64, absorbed queries of 576, q and kv low-rank) at a small
    hidden size, vocabulary and depth; per-head nope and value widths of 64
    (DeepSeek-V3: 128) halve the absorption's cost on a CPU. The *_scale
    fields size the random weights: attention strong enough that a wrong
    attention changes the tokens."""

    num_layers: int = 4
    num_heads: int = 8
    hidden: int = 128
    vocab: int = 512
    q_lora_rank: int = 96
    qk_nope_dim: int = 64
    v_head_dim: int = 64
    ffn: int = 256
    rope_theta: float = 10000.0
    seed: int = 0
    attn_out_scale: float = 1.5
    ffn_out_scale: float = 0.5
    head_scale: float = 4.0

    @property
    def softmax_scale(self) -> float:
        # As DeepSeek-V3: 1/sqrt(qk_nope + qk_rope), no rope scaling; here
        # 1/sqrt(128), not the server's default 1/sqrt(192), so every Verify
        # carries it.
        return 1.0 / math.sqrt(self.qk_nope_dim + ROPE)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to bf16 (nearest even) and back: what a bf16
    tensor on the wire holds."""
    return x.to(torch.bfloat16).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class MlaModel:
    """The model as plain tensors. A layer is split where its attention
    happens: `attention_inputs` gives the absorbed queries and the latent
    rows (both bf16-rounded: what travels), `attention_outputs` takes the
    512-wide attention output and finishes the layer. Whoever computes the
    attention in between (the server, or `local_attention` here) decides
    nothing else."""

    def __init__(self, config: ModelConfig, device: str = "cpu"):
        c = self.config = config
        rng = np.random.default_rng(config.seed)
        self.device = device

        def w(*shape, scale=1.0):
            # Unit-variance outputs for unit-variance inputs, times `scale`.
            fan_in = shape[-2] if len(shape) >= 2 else 1
            a = rng.standard_normal(shape, dtype=np.float32) * (scale / math.sqrt(fan_in))
            return torch.from_numpy(a).to(device)

        def g(n):  # an RMSNorm gain near 1
            return torch.from_numpy(1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).to(device)

        h, d = c.num_heads, c.hidden
        self.embed = torch.from_numpy(rng.standard_normal((c.vocab, d), dtype=np.float32)).to(device)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(dict(
                attn_norm=g(d),
                q_a=w(d, c.q_lora_rank), q_a_norm=g(c.q_lora_rank),
                q_b=w(c.q_lora_rank, h * (c.qk_nope_dim + ROPE)),
                kv_a=w(d, ROW), kv_a_norm=g(LATENT),
                # kv_b split into its key and value halves, per head: W_UK^T
                # [H, nope, 512] and W_UV [H, 512, v]; absorbed, W_UK multiplies
                # q_nope, W_UV the attention output.
                w_uk_t=w(h, c.qk_nope_dim, LATENT), w_uv=w(h, LATENT, c.v_head_dim),
                o=w(h * c.v_head_dim, d, scale=c.attn_out_scale),
                ffn_norm=g(d),
                gate=w(d, c.ffn), up=w(d, c.ffn), down=w(c.ffn, d, scale=c.ffn_out_scale)))
        self.final_norm = g(d)
        self.head = w(d, c.vocab, scale=c.head_scale)
        half = ROPE // 2
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half))

    # -- pieces ---------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary embedding of the last 64 dims; positions [T]."""
        angles = positions.float()[:, None] * self._inv_freq[None, :]        # [T, 32]
        cos, sin = torch.cos(angles), torch.sin(angles)
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., :ROPE // 2], x[..., ROPE // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def attention_inputs(self, layer: int, x: torch.Tensor,
                         positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q [T, H, 576], rows [T, 576]), bf16-rounded float32."""
        c, p = self.config, self.layers[layer]
        h = rms_norm(x, p["attn_norm"])
        cq = rms_norm(h @ p["q_a"], p["q_a_norm"])
        q = (cq @ p["q_b"]).view(-1, c.num_heads, c.qk_nope_dim + ROPE)
        q_nope, q_rope = q[..., :c.qk_nope_dim], q[..., c.qk_nope_dim:]
        kv = h @ p["kv_a"]
        latent = rms_norm(kv[:, :LATENT], p["kv_a_norm"])
        k_rope = self._rope(kv[:, LATENT:], positions)                       # shared by all heads
        # W_UK absorbed: per head q_nope [T, nope] @ W_UK^T [nope, 512].
        q_latent = torch.matmul(q_nope.transpose(0, 1), p["w_uk_t"]).transpose(0, 1)
        q_abs = torch.cat([q_latent, self._rope(q_rope, positions)], dim=-1)
        rows = torch.cat([latent, k_rope], dim=-1)
        return bf16_round(q_abs), bf16_round(rows)

    def attention_outputs(self, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], out [T, H, 512] (the latent attention output) -> the
        layer's output [T, hidden]."""
        p = self.layers[layer]
        heads = torch.matmul(out.transpose(0, 1), p["w_uv"]).transpose(0, 1)  # W_UV: [T, H, v]
        x = x + heads.reshape(x.shape[0], -1) @ p["o"]
        h = rms_norm(x, p["ffn_norm"])
        return x + (torch.nn.functional.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.final_norm) @ self.head

    def embed_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.embed[torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)]


def local_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The verify math in float32: q [n, H, 576], keys [m, 576], visible
    [n, m] bool -> out [n, H, 512], rounded to bf16 as the server answers."""
    n, h = q.shape[0], q.shape[1]
    scores = (q.reshape(n * h, ROW) @ keys.t()).view(n, h, -1) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return bf16_round((weights.view(n * h, -1) @ keys[:, :LATENT]).view(n, h, LATENT))


class LocalCache:
    """Latent rows of one sequence per layer, here: [layers][T, 576]."""

    def __init__(self, num_layers: int, capacity: int, device: str):
        self.rows = torch.zeros(num_layers, capacity, ROW, device=device)
        self.length = 0

    def causal_forward(self, model: MlaModel, tokens: Sequence[int], layers: int,
                       start_position: int) -> torch.Tensor:
        """Runs `tokens` (at start_position..) through the first `layers`
        layers with causal attention over the cache, appending their rows;
        returns the hidden states [T, hidden]."""
        t = len(tokens)
        assert start_position == self.length, (start_position, self.length)
        positions = torch.arange(start_position, start_position + t, device=model.device)
        x = model.embed_tokens(tokens)
        end = self.length + t
        visible = (torch.arange(end, device=model.device)[None, :] <=
                   positions[:, None])                                       # causal, with the prefix
        for layer in range(layers):
            q, rows = model.attention_inputs(layer, x, positions)
            self.rows[layer, self.length:end] = rows
            out = local_attention(q, self.rows[layer, :end], visible, model.config.softmax_scale)
            x = model.attention_outputs(layer, x, out)
        self.length = end
        return x


# -- the reference: plain greedy decoding -------------------------------------
@dataclass
class ReferenceRun:
    tokens: List[int]
    # Per generated token: (best logit, second best logit) of its step.
    top2: List[Tuple[float, float]]
    seconds: float


def greedy_reference(model: MlaModel, prompt: Sequence[int], num_tokens: int) -> ReferenceRun:
    """One token at a time, every layer's attention here over the cache."""
    c = model.config
    start = time.perf_counter()
    cache = LocalCache(c.num_layers, len(prompt) + num_tokens, model.device)
    x = cache.causal_forward(model, prompt, c.num_layers, 0)
    tokens, top2 = [], []
    logits = model.logits(x[-1:])[0]
    while True:
        best = torch.topk(logits, 2)
        tokens.append(int(best.indices[0]))
        top2.append((float(best.values[0]), float(best.values[1])))
        if len(tokens) == num_tokens:
            break
        x = cache.causal_forward(model, tokens[-1:], c.num_layers, cache.length)
        logits = model.logits(x)[0]
    return ReferenceRun(tokens, top2, time.perf_counter() - start)


# -- the draft proposer -------------------------------------------------------
@dataclass
class DraftTree:
    """Node 0 is the root: the last generated token, whose latent rows the
    server does not have yet. parents[i] < i; depth[0] = 0."""

    tokens: List[int]
    parents: List[int]
    depth: List[int]
    chain_depth: int  # the depth of the deepest (greedy) path

    def children(self, node: int) -> List[int]:
        return [i for i, p in enumerate(self.parents) if p == node]


class DraftProposer:
    """The target's first `layers` layers with its final norm and head (a
    self-speculative draft model), with a cache of its own. A tree: the
    draft's greedy chain from the root, `chain_depth` tokens deep, plus the
    draft's runner-up tokens as leaves along the chain (two at depth 1, then
    one per depth, until the tree has `num_drafts` drafts)."""

    def __init__(self, model: MlaModel, layers: int, num_drafts: int, chain_depth: int,
                 capacity: int):
        if not 1 <= chain_depth <= num_drafts:
            raise ValueError(f"chain depth {chain_depth} must be in 1..{num_drafts} (the drafts)")
        self.model, self.layers = model, layers
        self.num_drafts, self.chain_depth = num_drafts, chain_depth
        self.cache = LocalCache(layers, capacity, model.device)

    def propose(self, context: Sequence[int]) -> DraftTree:
        """context: every token so far (prompt, then generated), its last the
        root. The cache catches up over what it has not seen, then runs the
        chain past it and forgets the chain again."""
        done = self.cache.length
        x = self.cache.causal_forward(self.model, context[done:], self.layers, done)
        logits = self.model.logits(x[-1:])[0]
        base = self.cache.length
        chain, alternatives = [], []  # alternatives: (depth, token)
        spare = self.num_drafts - self.chain_depth
        root_order = torch.argsort(logits, descending=True)
        order = root_order
        for depth in range(1, self.chain_depth + 1):
            pick = int(order[0])
            chain.append(pick)
            take = min(2 if depth == 1 else 1, spare)
            alternatives += [(depth, int(order[k])) for k in range(1, 1 + take)]
            spare -= take
            if depth < self.chain_depth:
                x = self.cache.causal_forward(self.model, [pick], self.layers, self.cache.length)
                order = torch.argsort(self.model.logits(x)[0], descending=True)
        # A short chain leaves drafts over: more runner-ups at depth 1.
        alternatives += [(1, int(root_order[k])) for k in range(3, 3 + spare)]
        self.cache.length = base  # the chain was a guess: forget its rows
        return self._tree(context[-1], chain, alternatives)

    @staticmethod
    def _tree(root: int, chain: List[int], alternatives: List[Tuple[int, int]]) -> DraftTree:
        # Nodes in depth order, so parents come before children: at each depth
        # the chain's node first, then the alternatives (children of the
        # chain's node one level up).
        tokens, parents, depth = [root], [-1], [0]

        def add(token: int, parent: int, d: int) -> int:
            tokens.append(token)
            parents.append(parent)
            depth.append(d)
            return len(tokens) - 1

        chain_node = 0
        for d, pick in enumerate(chain, start=1):
            parent = chain_node
            chain_node = add(pick, parent, d)
            for alt_depth, token in alternatives:  # distinct ranks: no duplicate siblings
                if alt_depth == d:
                    add(token, parent, d)
        return DraftTree(tokens, parents, depth, len(chain))


class ReferenceProposer:
    """The target itself as the draft model, with misses: the chain is the
    target's own greedy continuation (the reference decode's next tokens,
    computed here beforehand), each chain token replaced by another with
    probability `miss`, plus random runner-ups as leaves. Acceptance then
    no longer depends on how deep the model is (a draft model of the first
    layers agrees with 61 random layers on almost nothing), and it rests on
    the server: where its attention or its committed rows are wrong, the
    target's picks leave the reference and the drafts stop being accepted.
    Same tree shape as DraftProposer."""

    def __init__(self, reference: Sequence[int], prompt_len: int, vocab: int, num_drafts: int,
                 chain_depth: int, miss: float, seed: int):
        if not 1 <= chain_depth <= num_drafts:
            raise ValueError(f"chain depth {chain_depth} must be in 1..{num_drafts} (the drafts)")
        if not 0.0 <= miss <= 1.0:
            raise ValueError(f"miss rate {miss} must be in 0..1")
        self.reference, self.prompt_len, self.vocab = list(reference), prompt_len, vocab
        self.num_drafts, self.chain_depth, self.miss = num_drafts, chain_depth, miss
        self.rng = np.random.default_rng(seed)

    def _other(self, avoid: Sequence[int]) -> int:
        while True:
            token = int(self.rng.integers(0, self.vocab))
            if token not in avoid:
                return token

    def propose(self, context: Sequence[int]) -> DraftTree:
        at = len(context) - self.prompt_len  # tokens generated so far (the root the last)
        chain, alternatives = [], []
        spare = self.num_drafts - self.chain_depth
        for depth in range(1, self.chain_depth + 1):
            k = at + depth - 1
            right = self.reference[k] if k < len(self.reference) else None
            pick = right if right is not None and self.rng.random() >= self.miss else None
            if pick is None:
                pick = self._other([] if right is None else [right])
            chain.append(pick)
            take = min(2 if depth == 1 else 1, spare)
            used = [pick]
            for _ in range(take):
                used.append(self._other(used))
                alternatives.append((depth, used[-1]))
            spare -= take
        used = [chain[0]] + [t for d, t in alternatives if d == 1]
        for _ in range(spare):
            used.append(self._other(used))
            alternatives.append((1, used[-1]))
        return DraftProposer._tree(context[-1], chain, alternatives)


def wrong_path(tree: DraftTree, path: List[int]) -> List[int]:
    """`path` with its last node swapped for a sibling (a draft the model did
    not pick): what a server that kept the wrong rows would hold."""
    if len(path) < 2:
        return path
    siblings = [c for c in tree.children(path[-2]) if c != path[-1]]
    return path[:-1] + siblings[:1] if siblings else path


# -- speculative decoding through the service ---------------------------------
def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Tuple[List[int], int]:
    """The longest root path whose every token is the model's greedy pick
    after its parent. Returns (path of node indices from the root, the
    model's pick after the path's last node: the next token)."""
    picks = torch.argmax(logits, dim=-1).tolist()
    path = [0]
    while True:
        node = path[-1]
        nxt = [c for c in tree.children(node) if tree.tokens[c] == picks[node]]
        if not nxt:
            return path, picks[node]
        path.append(nxt[0])


@dataclass
class SequenceState:
    index: int
    prompt: List[int]
    sequence_id: int = 0
    generated: List[int] = field(default_factory=list)
    committed: int = 0  # latent rows the server holds for this sequence
    drafter: Optional[object] = None  # DraftProposer or ReferenceProposer
    tree: Optional[DraftTree] = None


@dataclass
class StepStats:
    steps: int = 0
    drafts_accepted: int = 0
    tokens: int = 0
    accept_all: int = 0
    reject_all: int = 0
    histogram: Dict[int, int] = field(default_factory=dict)
    verify_calls: int = 0
    verify_seconds: float = 0.0


def cuda_shm_support():
    """The package's CUDA shared-memory region class, or None when this
    version of the package has none."""
    try:
        from mlaverify.cuda_shm import CudaSharedMemoryRegion
    except ImportError:
        return None
    if not hasattr(VerifyClient, "register_cuda_shared_memory"):
        return None
    return CudaSharedMemoryRegion


class Plane:
    """How one Verify item's tensors travel: inline bytes, or references into
    a shared-memory region registered once (system: /dev/shm; CUDA: device
    memory of this process), one slot per item of a call. A slot is reused
    by the next layer: its out/lse are read before the next Verify.
    "steps": device-driven steps (docs/steps.md) with host doorbells: one
    OpenStep per decode step names the slots once, then each layer's q and
    draft rows are written into them, the doorbell rung and the completion
    awaited; no call per layer."""

    def __init__(self, client: VerifyClient, kind: str, max_items: int, max_nodes: int,
                 num_heads: int, device: str):
        self.client, self.kind, self.num_heads = client, kind, num_heads
        self.region = None
        self.name = f"spec-decode-{id(self):x}"
        self.slot_bytes = item_bytes(max_nodes, num_heads)
        self.doorbells = self.slot_bytes * max_items  # the two step slots, after the items
        if kind in ("system-shm", "steps"):
            self.region = SharedMemoryRegion(self.doorbells + 2 * SLOT_BYTES)
            client.register_system_shared_memory(self.name, self.region)
        elif kind == "cuda-shm":
            region_class = cuda_shm_support()
            if region_class is None:
                raise RuntimeError("cuda-shm needs the CUDA shared-memory support of the mlaverify "
                                   "package (mlaverify.cuda_shm)")
            self.region = region_class(self.slot_bytes * max_items, device=device)
            client.register_cuda_shared_memory(self.name, self.region)
        elif kind != "inline":
            raise ValueError(f"plane {kind!r}: one of {', '.join(PLANES)}")

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A bf16-rounded float32 tensor as VerifyItem takes it: bf16, on the
        host for inline and system shm, where it is for CUDA shm (the package
        copies it into the region on the device)."""
        t = t.to(torch.bfloat16)
        return t if self.kind == "cuda-shm" else t.cpu()

    def item(self, slot: int, sequence_id: int, q, rows, parents) -> VerifyItem:
        if self.kind == "inline":
            return VerifyItem(sequence_id, self.tensor(q), self.tensor(rows), parents)
        placement = place_item(self.name, slot * self.slot_bytes, len(parents), self.num_heads)
        return VerifyItem(sequence_id, self.tensor(q), self.tensor(rows), parents, shm=placement)

    def open_step(self, active, scale: float):
        """steps: one OpenStep for the decode step of `active` (each item in
        its slot, one place for every layer)."""
        self.places = [place_item(self.name, k * self.slot_bytes, len(s.tree.parents),
                                  self.num_heads) for k, s in enumerate(active)]
        rank = StepRank([StepItemPlacement.of(p) for p in self.places], self.name,
                        self.doorbells, self.doorbells + SLOT_BYTES)
        return self.client.open_step([(s.sequence_id, s.tree.parents) for s in active], [rank],
                                     softmax_scale=scale)

    def step_layer(self, step, layer: int, inputs) -> List[torch.Tensor]:
        """steps: one layer: every item's q and draft rows into its slot, the
        ring, the wait; returns each item's out [N, H, 512] (bf16)."""
        h = self.num_heads
        for place, (q, rows) in zip(self.places, inputs):
            n = len(rows)
            bits = lambda t: t.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
            self.region.array(place.q_offset, np.uint16, (n, h, ROW))[...] = bits(q)
            self.region.array(place.draft_kv_offset, np.uint16, (n, ROW))[...] = bits(rows)
        step.ring(0, layer + 1)
        step.wait(0, layer + 1)
        outs = []
        for place, (_, rows) in zip(self.places, inputs):
            n = len(rows)
            out = self.region.array(place.out_offset, np.uint16, (n, h, LATENT)).copy()
            outs.append(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16))
        return outs

    def close(self) -> None:
        if self.region is not None:
            if self.kind in ("system-shm", "steps"):
                self.client.unregister_system_shared_memory(self.name)
            else:
                self.client.unregister_cuda_shared_memory(self.name)
            self.region.close()
            self.region = None


def speculative_decode(client: VerifyClient, model: MlaModel, prompts: List[List[int]],
                       num_tokens: int, *, draft_layers: int, num_drafts: int, chain_depth: int,
                       batch: int, plane: str, softmax_scale: float = 0.0,
                       references: Optional[List[List[int]]] = None, draft_miss: float = 0.25,
                       seed: int = 0, commit_wrong_path: bool = False
                       ) -> Tuple[List[List[int]], StepStats, float]:
    """Decodes every prompt with drafts verified by the server, `batch`
    sequences per Verify. softmax_scale: what Verify is sent (0: the
    model's). references: each prompt's greedy tokens, for a
    ReferenceProposer missing `draft_miss` of its chain tokens (None: a
    DraftProposer of `draft_layers` layers). commit_wrong_path: commit a
    sibling of each step's last accepted node instead (a check that such a
    server is caught). Returns (tokens per prompt, statistics, seconds)."""
    c = model.config
    scale = softmax_scale or c.softmax_scale
    stats = StepStats()
    start = time.perf_counter()
    transport = Plane(client, plane, batch, num_drafts + 1, c.num_heads, model.device)
    results: List[List[int]] = [[] for _ in prompts]
    try:
        for first in range(0, len(prompts), batch):
            group = [SequenceState(i, list(prompts[i]))
                     for i in range(first, min(first + batch, len(prompts)))]
            for s in group:
                capacity = len(s.prompt) + num_tokens + num_drafts + 2
                cache = LocalCache(c.num_layers, len(s.prompt), model.device)
                x = cache.causal_forward(model, s.prompt, c.num_layers, 0)
                s.sequence_id = client.create_sequence(f"spec_decode prompt {s.index}")
                s.committed = client.append_prompt(s.sequence_id,
                                                   cache.rows.to(torch.bfloat16).cpu())
                s.generated.append(int(torch.argmax(model.logits(x[-1:])[0])))
                if references is None:
                    s.drafter = DraftProposer(model, draft_layers, num_drafts, chain_depth,
                                              capacity)
                else:
                    s.drafter = ReferenceProposer(references[s.index], len(s.prompt), c.vocab,
                                                  num_drafts, chain_depth, draft_miss,
                                                  seed * 7919 + s.index)
            active = [s for s in group if len(s.generated) < num_tokens]
            while active:
                xs, positions = [], []
                for s in active:
                    s.tree = s.drafter.propose(s.prompt + s.generated)
                    positions.append(torch.as_tensor([s.committed + d for d in s.tree.depth],
                                                     device=model.device))
                    xs.append(model.embed_tokens(s.tree.tokens))
                step = transport.open_step(active, scale) if plane == "steps" else None
                if step is not None:
                    for s, prefix in zip(active, step.prefix_len):
                        if prefix != s.committed:
                            raise RuntimeError(f"prompt {s.index}: the step attends to {prefix} "
                                               f"rows, {s.committed} committed")
                for layer in range(c.num_layers):
                    inputs = [model.attention_inputs(layer, x, pos) for x, pos in zip(xs, positions)]
                    t0 = time.perf_counter()
                    if step is not None:
                        outs = transport.step_layer(step, layer, inputs)
                    else:
                        items = [transport.item(k, s.sequence_id, q, rows, s.tree.parents)
                                 for k, (s, (q, rows)) in enumerate(zip(active, inputs))]
                        answers = client.verify(layer, items, softmax_scale=scale)
                        for s, answer in zip(active, answers):
                            if answer.prefix_len != s.committed:
                                raise RuntimeError(f"prompt {s.index}: the server attended to "
                                                   f"{answer.prefix_len} rows, {s.committed} "
                                                   "committed")
                        outs = [answer.out for answer in answers]
                    stats.verify_seconds += time.perf_counter() - t0
                    stats.verify_calls += 1
                    for k, out in enumerate(outs):
                        xs[k] = model.attention_outputs(layer, xs[k], out.to(model.device).float())
                for s, x in zip(active, xs):
                    path, bonus = accept_greedy(s.tree, model.logits(x))
                    result = client.commit(s.sequence_id, wrong_path(s.tree, path)
                                           if commit_wrong_path else path)
                    s.committed += len(path)
                    if result.length != s.committed:
                        raise RuntimeError(f"prompt {s.index}: committed length {result.length}, "
                                           f"expected {s.committed}")
                    accepted = len(path) - 1
                    s.generated.extend([s.tree.tokens[i] for i in path[1:]] + [bonus])
                    stats.steps += 1
                    stats.drafts_accepted += accepted
                    stats.tokens += accepted + 1
                    stats.histogram[accepted] = stats.histogram.get(accepted, 0) + 1
                    stats.accept_all += accepted == s.tree.chain_depth
                    stats.reject_all += accepted == 0
                active = [s for s in active if len(s.generated) < num_tokens]
            for s in group:
                client.release_sequence(s.sequence_id)
                results[s.index] = s.generated[:num_tokens]
    finally:
        transport.close()
    return results, stats, time.perf_counter() - start


# -- comparison and report -----------------------------------------------------
def compare(spec: List[int], ref: ReferenceRun, tie_rtol: float = TIE_RTOL) -> Optional[dict]:
    """None when equal; else the first position where they differ, whether
    the reference's top-2 logits there were a tie within bf16 rounding."""
    for pos, (a, b) in enumerate(zip(spec, ref.tokens)):
        if a != b:
            best, second = ref.top2[pos]
            gap = best - second
            tol = tie_rtol * max(abs(best), abs(second), 1.0)
            return dict(position=pos, spec=a, reference=b, gap=gap, tolerance=tol, tie=gap <= tol)
    if len(spec) != len(ref.tokens):
        return dict(position=min(len(spec), len(ref.tokens)), spec=None, reference=None,
                    gap=None, tolerance=None, tie=False)
    return None


def make_prompts(count: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    """`count` random prompts of length//2 .. length tokens."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, vocab, int(rng.integers(max(1, length // 2), length + 1))).tolist()
            for _ in range(count)]


def run(args: argparse.Namespace) -> Tuple[int, dict]:
    """The whole comparison; returns (exit status, report)."""
    torch.set_num_threads(max(1, args.threads))
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return 2, dict(error=f"--device {args.device}: torch sees no CUDA device")
        # float32 means float32: no TF32 in the model's products, here or in the reference.
        torch.backends.cuda.matmul.allow_tf32 = False
    with VerifyClient(args.target, timeout=args.timeout, as_torch=True) as client:
        info = client.server_info()
        layers = args.layers or info.num_layers
        heads = info.num_heads
        if layers != info.num_layers:
            return 2, dict(error=f"the model has {layers} layers, the server {info.num_layers}: "
                                 f"start it with --layers {layers}")
        num_drafts = args.drafts
        if num_drafts + 1 > info.max_draft_len:
            return 2, dict(error=f"a tree of {num_drafts + 1} nodes, the server takes at most "
                                 f"{info.max_draft_len} (its largest --draft-buckets)")
        if args.plane == "cuda-shm" and cuda_shm_support() is None:
            return 2, dict(error="cuda-shm needs the CUDA shared-memory support of the mlaverify "
                                 "package (mlaverify.cuda_shm), which this version lacks")
        if args.plane == "cuda-shm" and not args.device.startswith("cuda"):
            return 2, dict(error="cuda-shm keeps the tensors on the GPU: run the model there "
                                 "(--device cuda)")
        if args.plane == "steps" and not info.host_doorbells:
            return 2, dict(error="the server opens no device-driven steps with host doorbells "
                                 "(--step-lanes 0)")
        if args.plane != "inline" and not info.client_shared_memory:
            return 2, dict(error="the server does not take client shared memory: start it with "
                                 "--allow-client-shm true")
        config = ModelConfig(num_layers=layers, num_heads=heads, seed=args.seed)
        model = MlaModel(config, args.device)
        prompts = make_prompts(args.prompts, args.prompt_len, config.vocab, args.seed)
        batch = max(1, min(args.batch, info.max_batch))

        # Warm the model's code paths so that the first clock does not count them.
        greedy_reference(model, prompts[0][:4], 2)
        refs = [greedy_reference(model, p, args.tokens) for p in prompts]
        ref_seconds = sum(r.seconds for r in refs)
        spec, stats, spec_seconds = speculative_decode(
            client, model, prompts, args.tokens, draft_layers=args.draft_layers,
            num_drafts=num_drafts, chain_depth=args.chain_depth, batch=batch, plane=args.plane,
            softmax_scale=args.verify_scale,
            references=[r.tokens for r in refs] if args.drafter == "reference" else None,
            draft_miss=args.draft_miss, seed=args.seed,
            commit_wrong_path=args.testing_commit_wrong_path)

    divergences, compared = [], 0
    for i, (tokens, ref) in enumerate(zip(spec, refs)):
        d = compare(tokens, ref, args.tie_rtol)
        # Equal up to the first difference; after it the two decode different texts.
        compared += len(tokens) if d is None else d["position"]
        if d is not None:
            divergences.append(dict(prompt=i, **d))
    ties = sum(1 for d in divergences if d["tie"])
    errors = len(divergences) - ties
    generated = sum(len(t) for t in spec)
    report = dict(
        plane=args.plane, target=args.target, backend=info.backend, server_layers=info.num_layers,
        server_heads=info.num_heads, page_size=info.page_size,
        model=asdict(config), softmax_scale=config.softmax_scale,
        verify_scale=args.verify_scale or config.softmax_scale, drafter=args.drafter,
        draft_layers=args.draft_layers, draft_miss=args.draft_miss,
        commit_wrong_path=args.testing_commit_wrong_path,
        device=args.device, torch=torch.__version__,
        prompts=len(prompts), prompt_tokens=sum(len(p) for p in prompts), tokens_per_prompt=args.tokens,
        tree_nodes=num_drafts + 1, drafts_per_tree=num_drafts, chain_depth=args.chain_depth,
        batch=batch,
        steps=stats.steps, acceptance_length=stats.tokens / max(1, stats.steps),
        drafts_accepted_per_step=stats.drafts_accepted / max(1, stats.steps),
        accepted_histogram={str(k): v for k, v in sorted(stats.histogram.items())},
        accept_all_steps=stats.accept_all, reject_all_steps=stats.reject_all,
        verify_calls=stats.verify_calls,
        verify_ms_per_call=1e3 * stats.verify_seconds / max(1, stats.verify_calls),
        generated_tokens=generated, spec_seconds=spec_seconds,
        spec_tokens_per_s=generated / spec_seconds, reference_seconds=ref_seconds,
        reference_tokens_per_s=generated / ref_seconds if ref_seconds else None,
        tokens_compared=compared, tie_rtol=args.tie_rtol,
        tie_divergences=ties, divergences=errors, divergence_detail=divergences,
        equal=errors == 0)
    return (0 if errors == 0 else 1), report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051", help="the server, host:port")
    ap.add_argument("--plane", choices=PLANES, default="inline",
                    help="how q, draft KV, out and lse travel (system-shm, steps: the server "
                         "runs with --allow-client-shm true, on this host; steps: one OpenStep "
                         "per decode step, every layer through host doorbells, no call per "
                         "layer)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="the longest prompt; lengths are drawn from half of it up")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--drafts", type=int, default=10,
                    help="draft tokens per tree (the tree has one more node: its root)")
    ap.add_argument("--chain-depth", type=int, default=5, help="depth of the draft's greedy chain")
    ap.add_argument("--drafter", choices=("reference", "layers"), default="reference",
                    help="reference: the target's own greedy tokens (computed beforehand), each "
                         "chain token missed with probability --draft-miss, so that drafts are "
                         "accepted at any depth; layers: a draft model of the target's first "
                         "--draft-layers layers (agrees with few-layer models only)")
    ap.add_argument("--draft-miss", type=float, default=0.25,
                    help="reference drafter: probability that a chain token is wrong")
    ap.add_argument("--draft-layers", type=int, default=3,
                    help="layers of the layers drafter (the target's first ones)")
    ap.add_argument("--testing-commit-wrong-path", action="store_true",
                    help="commit a sibling of each step's last accepted node (the rows of a "
                         "draft the model did not pick): the comparison must then fail")
    ap.add_argument("--batch", type=int, default=4, help="sequences per Verify")
    ap.add_argument("--layers", type=int, default=0, help="model layers (0: the server's)")
    ap.add_argument("--seed", type=int, default=0, help="the model's weights and the prompts")
    ap.add_argument("--tie-rtol", type=float, default=TIE_RTOL,
                    help="a divergence is a tie when the reference's top-2 logits differ by at "
                         "most this times the larger (at least 1)")
    ap.add_argument("--verify-scale", type=float, default=0.0,
                    help="the softmax scale sent with Verify (0: the model's own, 1/sqrt(128); "
                         "another value shows that a wrong scale is caught)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    ap.add_argument("--json", help="write the report here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    status, report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if "error" in report:
        print(f"spec_decode: {report['error']}", file=sys.stderr)
        return status
    r = report
    print(f"server {r['target']} ({r['backend']}, {r['server_layers']} layers, {r['server_heads']} "
          f"heads), plane {r['plane']}, model on {r['device']}")
    print(f"{r['prompts']} prompts x {r['tokens_per_prompt']} tokens, trees of {r['tree_nodes']} "
          f"nodes ({r['drafts_per_tree']} drafts, chain {r['chain_depth']}), {r['steps']} steps")
    print(f"acceptance length {r['acceptance_length']:.2f} tokens/step "
          f"(accepted drafts per step: {r['accepted_histogram']}); accept-all steps "
          f"{r['accept_all_steps']}, reject-all steps {r['reject_all_steps']}")
    layers = "step layers (rung and awaited)" if r["plane"] == "steps" else "Verify calls"
    print(f"speculative {r['spec_tokens_per_s']:.1f} tokens/s ({r['verify_calls']} {layers}, "
          f"{r['verify_ms_per_call']:.2f} ms each); reference {r['reference_tokens_per_s']:.1f} "
          f"tokens/s")
    for d in r["divergence_detail"]:
        kind = "tie" if d["tie"] else "DIVERGENCE"
        print(f"{kind}: prompt {d['prompt']} token {d['position']}: speculative {d['spec']}, "
              f"reference {d['reference']} (top-2 gap {d['gap']}, tolerance {d['tolerance']})")
    verdict = "PASS" if r["equal"] else "FAIL"
    print(f"{verdict}: {r['tokens_compared']} of {r['generated_tokens']} tokens compared equal, "
          f"{r['tie_divergences']} tie divergence(s), {r['divergences']} other divergence(s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
