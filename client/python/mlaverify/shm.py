"""System shared memory for a scheduler on the server's host: tensors travel
as references into a region both processes map, not as bytes through gRPC
(servers started with --allow-client-shm).

    region = SharedMemoryRegion(1 << 20)                  # /dev/shm, removed by close()
    client.register_system_shared_memory("sched-0", region)
    place = place_item("sched-0", 0, n, info.num_heads)   # offsets of q, draft_kv, out, lse
    item = VerifyItem(seq, q, draft_kv, parents, shm=place)
    (result,) = client.verify(layer, [item])              # q/draft_kv copied in; out/lse read back
    client.unregister_system_shared_memory("sched-0")
    region.close()
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

LATENT_DIM = 576
VALUE_DIM = 512
# Keys start with the server's default --shm-key-prefix.
KEY_PREFIX = "mlaverify-py"
_next_region = itertools.count()


def _align(v: int) -> int:
    """`v` rounded up to a multiple of 256."""
    return (v + 255) // 256 * 256


class SharedMemoryRegion:
    """A new POSIX shared-memory object of `size` bytes, mapped here. `key` is
    what RegisterSystemSharedMemory takes ("/mlaverify-py-<pid>-<n>-<random>",
    under the server's default --shm-key-prefix; the object belongs to this
    process's user, who must be the server's); `close()` unmaps and removes
    it."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"a shared-memory region of {size} bytes")
        name = f"{KEY_PREFIX}-{os.getpid()}-{next(_next_region)}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.key = "/" + self._shm.name
        self.size = size

    @property
    def buffer(self) -> memoryview:
        """The region's bytes."""
        return self._shm.buf

    def array(self, offset: int, dtype, shape) -> np.ndarray:
        """A NumPy view of the region's bytes at `offset`."""
        count = math.prod(shape)  # not np.prod: per call, a NumPy reduction costs more
        return np.frombuffer(self._shm.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    @property
    def closed(self) -> bool:
        """Whether close() ran (the mapping is gone)."""
        return self._shm.buf is None

    def close(self) -> None:
        """Unmaps the region and removes the object (unregister it first)."""
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ShmPlacement:
    """Where one item's tensors sit in registered region `region`: byte
    offsets from the start of the registered range."""

    region: str
    q_offset: int
    draft_kv_offset: int
    out_offset: int
    lse_offset: int
    end_offset: int
    # The item's N and H (place_item fills them; CudaSharedMemoryRegion.item_views uses them).
    num_drafts: int = 0
    num_heads: int = 0


def item_bytes(num_drafts: int, num_heads: int) -> int:
    """Bytes place_item lays out for one item (256-byte aligned parts)."""
    n, h = num_drafts, num_heads
    return (_align(n * h * LATENT_DIM * 2) + _align(n * LATENT_DIM * 2) +
            _align(n * h * VALUE_DIM * 2) + _align(n * h * 4))


def place_item(region: str, offset: int, num_drafts: int, num_heads: int) -> ShmPlacement:
    """An item's q, draft_kv, out and lse laid out from `offset` (rounded up
    to 256) of the registered range of `region`."""
    n, h = num_drafts, num_heads
    q = _align(offset)
    kv = q + _align(n * h * LATENT_DIM * 2)
    out = kv + _align(n * LATENT_DIM * 2)
    lse = out + _align(n * h * VALUE_DIM * 2)
    return ShmPlacement(region, q, kv, out, lse, lse + _align(n * h * 4), n, h)
