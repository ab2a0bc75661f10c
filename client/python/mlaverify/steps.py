"""Device-driven verify steps (docs/steps.md): one OpenStep per decode step
names where every layer's tensors live in registered regions; then each
layer is rung through a doorbell once its inputs are in place and awaited on
a completion slot, with no call per layer. The items are committed with
VerifyClient.commit, as after Verify calls.

Host doorbells (slots in a registered system region; every backend):

    region = SharedMemoryRegion(size)
    client.register_system_shared_memory("steps", region)
    rank = StepRank([StepItemPlacement.of(place_item("steps", 0, n, heads))],
                    doorbell_region="steps", doorbell_offset=slots, completion_offset=slots + 16)
    step = client.open_step([(sequence_id, parents)], [rank])
    for layer in range(step.num_layers):
        ...write layer's q and draft_kv at the placement...
        step.ring(0, layer + 1)
        step.wait(0, layer + 1)       # out and lse are there now
    client.commit(sequence_id, path)

GPU doorbells (doorbell="gpu", tensors in a CUDA region, a CUDA server):
ring_on_stream / wait_on_stream put a stream write and a stream wait on a
torch CUDA stream (the current one by default): no host thread per layer,
ordered after the kernels that wrote the inputs and before those that read
the outputs, and capturable into the caller's CUDA graphs. They call the
CUDA driver (libcuda) through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from mlaverify import shm, types
from mlaverify.errors import VerifyError
from mlaverify.v1 import verify_pb2

SLOT_BYTES = 16  # a host slot: uint64 value, uint32 futex waiters, 4 reserved
SLOT_ALIGNMENT = 16


@dataclass(frozen=True)
class StepTensor:
    """Layer l's tensor starts at offset + l * layer_stride of `region`
    (layer_stride 0: one place for every layer)."""

    region: str
    offset: int
    layer_stride: int = 0


@dataclass(frozen=True)
class StepItemPlacement:
    """One item's tensors on one rank: q bf16 [N, H_r, 576], draft_kv bf16
    [N, 576], out bf16 [N, H_r, 512], lse fp32 [N, H_r]."""

    q: StepTensor
    draft_kv: StepTensor
    out: StepTensor
    lse: StepTensor

    @staticmethod
    def of(place: shm.ShmPlacement, layer_stride: int = 0) -> "StepItemPlacement":
        """From a place_item placement: every tensor where it put it (the same
        place every layer unless `layer_stride`)."""
        return StepItemPlacement(*(StepTensor(place.region, offset, layer_stride) for offset in (
            place.q_offset, place.draft_kv_offset, place.out_offset, place.lse_offset)))


@dataclass(frozen=True)
class StepRank:
    """One rank: TP servers have one per device, in the server's device order
    (rank r computes heads r*H_r .. (r+1)*H_r - 1), DP servers one. Host
    doorbells: the two 16-byte slots in a registered system region."""

    items: Sequence[StepItemPlacement]
    doorbell_region: str = ""
    doorbell_offset: int = 0
    completion_offset: int = 0


def open_step_request(items: Sequence[Tuple[int, Sequence[int]]], ranks: Sequence[StepRank],
                      doorbell: str = "host", softmax_scale: float = 0.0,
                      layer_timeout_ms: int = 0, max_duration_ms: int = 0
                      ) -> verify_pb2.OpenStepRequest:
    """The OpenStep request (items: (sequence_id, parents) pairs)."""
    kinds = {"host": verify_pb2.DOORBELL_HOST, "gpu": verify_pb2.DOORBELL_GPU}
    if doorbell not in kinds:
        raise ValueError(f"doorbell {doorbell!r}: 'host' or 'gpu'")
    r = verify_pb2.OpenStepRequest(doorbell=kinds[doorbell], softmax_scale=softmax_scale,
                                   layer_timeout_ms=layer_timeout_ms,
                                   max_duration_ms=max_duration_ms)
    for sequence_id, parents in items:
        r.items.add(sequence_id=sequence_id, parents=list(parents))
    for rank in ranks:
        out = r.ranks.add(doorbell_region=rank.doorbell_region if doorbell == "host" else "",
                          doorbell_offset=rank.doorbell_offset if doorbell == "host" else 0,
                          completion_offset=rank.completion_offset if doorbell == "host" else 0)
        for p in rank.items:
            place = out.items.add()
            for name in ("q", "draft_kv", "out", "lse"):
                t: StepTensor = getattr(p, name)
                getattr(place, name).CopyFrom(verify_pb2.StepTensor(
                    region=t.region, offset=t.offset, layer_stride=t.layer_stride))
    return r


# -- host slots -----------------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)


class HostSlot:
    """A 16-byte slot (common/host_doorbell.h) of a SharedMemoryRegion of this
    process. It holds no view of the region (which could then not be
    closed): each access checks that the region is still mapped."""

    def __init__(self, region: Any, offset: int):
        if offset % SLOT_ALIGNMENT:
            raise ValueError(f"a slot at offset {offset}: not 16-byte aligned")
        self._region = region
        view = np.frombuffer(region.buffer, dtype=np.uint64, count=1, offset=offset)
        self._address = view.ctypes.data
        del view  # (no export left: the region can still be closed)
        self._value = ctypes.c_uint64.from_address(self._address)

    def _mapped(self) -> None:
        if getattr(self._region, "closed", False):
            raise ValueError("the doorbell region was closed under an open step")

    def load(self) -> int:
        """The slot's value now."""
        self._mapped()
        return self._value.value

    def store(self, value: int) -> None:
        """Stores the value (one aligned 8-byte store), then wakes whoever
        sleeps on the slot. The wake is unconditional: the syscall orders the
        store before it, so a waiter either sees the value or is woken."""
        self._mapped()
        self._value.value = value
        if _SYS_FUTEX is not None:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._address), _FUTEX_WAKE, 0x7FFFFFFF,
                          None, None, 0)

    def wait_at_least(self, target: int, timeout: float, spin: float) -> int:
        """Until the value is >= target: reads in a busy loop for `spin`
        seconds, then every 50 us, until `timeout`; returns the last value."""
        self._mapped()
        start = time.perf_counter()
        value = self._value.value
        while value < target:
            elapsed = time.perf_counter() - start
            if elapsed >= timeout:
                break
            if elapsed >= spin:
                time.sleep(50e-6)
            value = self._value.value
        return value


# -- GPU doorbells: the CUDA driver through ctypes -----------------------------------
class _CuIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_driver: Optional[ctypes.CDLL] = None


def _cuda() -> ctypes.CDLL:
    """libcuda with the functions GPU doorbells use (their CUDA 12 forms)."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"GPU doorbells need the CUDA driver (libcuda.so.1): {e}") from e
        c = ctypes
        lib.cuStreamWriteValue64_v2.argtypes = [c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint]
        lib.cuStreamWaitValue64_v2.argtypes = [c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint]
        lib.cuIpcOpenMemHandle_v2.argtypes = [c.POINTER(c.c_uint64), _CuIpcMemHandle, c.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [c.c_uint64]
        lib.cuMemcpyDtoH_v2.argtypes = [c.c_void_p, c.c_uint64, c.c_size_t]
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


_CU_STREAM_WAIT_VALUE_GEQ = 0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
# (IPC handle, device) -> the arena's address in this process; kept while the
# process lives (a server's arena is never freed while it runs).
_arenas: Dict[Tuple[bytes, int], int] = {}


def _arena(handle: bytes, device: int) -> int:
    key = (handle, device)
    if key not in _arenas:
        import torch  # the CUDA context is torch's (its current device's primary context)
        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)
        address = ctypes.c_uint64(0)
        if len(handle) != ctypes.sizeof(_CuIpcMemHandle):
            raise ValueError(f"the server's doorbell arena handle has {len(handle)} bytes, "
                             f"a CUDA IPC handle {ctypes.sizeof(_CuIpcMemHandle)}")
        h = _CuIpcMemHandle()
        ctypes.memmove(ctypes.byref(h), handle, len(handle))
        _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(address), h,
                                             _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "opening the server's doorbell arena (cuIpcOpenMemHandle)")
        _arenas[key] = address.value
    return _arenas[key]


def _stream_handle(stream: Any, device: int) -> int:
    if stream is None:
        import torch
        stream = torch.cuda.current_stream(device)
    return int(getattr(stream, "cuda_stream", stream))


# -- the step -----------------------------------------------------------------------
class DeviceStep:
    """An open step (VerifyClient.open_step). Ranks are independent; one
    thread at a time per rank."""

    def __init__(self, client: Any, response: verify_pb2.OpenStepResponse, doorbell: str,
                 ranks: Sequence[StepRank], regions: Dict[str, Any]):
        self._client = client
        self.step_id = response.step_id
        self.num_layers = response.num_layers
        self.prefix_len = list(response.prefix_len)
        self.doorbell = doorbell
        self.response = response
        self._bases = [r.base for r in response.ranks]
        self._slots: List[Tuple[HostSlot, HostSlot]] = []
        self._words: List[Tuple[int, int, int]] = []  # GPU: doorbell, completion, device
        for k, db in enumerate(response.ranks):
            if doorbell == "host":
                view = regions.get(ranks[k].doorbell_region)
                region = getattr(view, "_region", None)
                if getattr(region, "buffer", None) is None:
                    raise ValueError(f"rank {k}: the doorbell region {ranks[k].doorbell_region!r} "
                                     "is not a system region registered by this client")
                base = view._offset
                self._slots.append((HostSlot(region, base + ranks[k].doorbell_offset),
                                    HostSlot(region, base + ranks[k].completion_offset)))
            else:
                arena = _arena(db.arena_handle, db.device_id)
                self._words.append((arena + db.doorbell_offset, arena + db.completion_offset,
                                    db.device_id))

    @property
    def ranks(self) -> int:
        """The step's ranks (a TP server's devices, or 1)."""
        return len(self._bases)

    def _check(self, rank: int, layers: int, kind: str) -> None:
        if kind != self.doorbell:
            raise ValueError(f"step {self.step_id} has {self.doorbell} doorbells")
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} of a step with {self.ranks} ranks")
        if not 1 <= layers <= self.num_layers:
            raise ValueError(f"{layers} layers; the step has 1..{self.num_layers}")

    def _ended(self, rank: int, value: int) -> VerifyError:
        return VerifyError(grpc.StatusCode.ABORTED,
                           f"step {self.step_id} ended early (rank {rank}'s completion holds "
                           f"{value - self._bases[rank]} of {self.num_layers} layers): its "
                           "outputs are not to be used; status() says why", "step")

    def ring(self, rank: int, layers: int) -> None:
        """Host doorbells: layers [0, layers) of `rank` have their inputs in place."""
        self._check(rank, layers, "host")
        self._slots[rank][0].store(self._bases[rank] + layers)

    def wait(self, rank: int, layers: int, timeout: float = 30.0, spin: float = 0.02) -> None:
        """Host doorbells: until layers [0, layers) of `rank` ran. VerifyError
        ABORTED when the step ended early, DEADLINE_EXCEEDED after `timeout`."""
        self._check(rank, layers, "host")
        target = self._bases[rank] + layers
        seen = self._slots[rank][1].wait_at_least(target, timeout, spin)
        if seen < target:
            raise VerifyError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"step {self.step_id}: rank {rank} ran "
                              f"{max(0, seen - self._bases[rank])} of {layers} layers within "
                              f"{timeout} s", "step")
        if seen > self._bases[rank] + self.num_layers:
            raise self._ended(rank, seen)

    def ring_on_stream(self, rank: int, layers: int, stream: Any = None) -> None:
        """GPU doorbells: a stream write of the doorbell on `stream` (a torch
        CUDA stream or its handle; None: the current stream of the rank's
        device), after the work before it on that stream."""
        self._check(rank, layers, "gpu")
        doorbell, _, device = self._words[rank]
        _check(_cuda().cuStreamWriteValue64_v2(_stream_handle(stream, device), doorbell,
                                               self._bases[rank] + layers,
                                               _CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64")

    def wait_on_stream(self, rank: int, layers: int, stream: Any = None) -> None:
        """GPU doorbells: a stream wait on the completion on `stream`: the work
        after it sees layers [0, layers) of `rank` done."""
        self._check(rank, layers, "gpu")
        _, completion, device = self._words[rank]
        _check(_cuda().cuStreamWaitValue64_v2(_stream_handle(stream, device), completion,
                                              self._bases[rank] + layers,
                                              _CU_STREAM_WAIT_VALUE_GEQ),
               "cuStreamWaitValue64")

    def completed(self, rank: int) -> int:
        """How many layers of `rank` ran (GPU doorbells: a small synchronous
        copy). VerifyError ABORTED when the step ended early."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} of a step with {self.ranks} ranks")
        if self.doorbell == "host":
            value = self._slots[rank][1].load()
        else:
            word = ctypes.c_uint64(0)
            _check(_cuda().cuMemcpyDtoH_v2(ctypes.byref(word), self._words[rank][1], 8),
                   "reading a completion word")
            value = word.value
        if value > self._bases[rank] + self.num_layers:
            raise self._ended(rank, value)
        return max(0, value - self._bases[rank])

    def abort(self, timeout: Optional[float] = None, *,
              metadata: Optional[Sequence[Tuple[str, str]]] = None) -> types.StepStatus:
        """AbortStep: returns once nothing of the step runs any more (from an
        AsyncVerifyClient's step: a coroutine of it). timeout, metadata: as
        the client's abort_step takes them."""
        return self._client.abort_step(self.step_id, timeout, metadata=metadata)

    def status(self, timeout: Optional[float] = None, *,
               metadata: Optional[Sequence[Tuple[str, str]]] = None) -> types.StepStatus:
        """GetStep (from an AsyncVerifyClient's step: a coroutine of it).
        timeout, metadata: as the client's get_step takes them."""
        return self._client.get_step(self.step_id, timeout, metadata=metadata)
