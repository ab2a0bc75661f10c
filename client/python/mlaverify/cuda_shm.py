"""CUDA shared memory: Verify tensors in device memory of this process that
the server reads and writes in place (servers with the CUDA backend and
--allow-client-shm, on the same host).

    region = CudaSharedMemoryRegion(1 << 20, device="cuda:0")  # torch's allocator
    client.register_cuda_shared_memory("gpu-0", region)
    place = place_item("gpu-0", 0, n, info.num_heads)
    views = region.item_views(place)                          # q, draft_kv, out, lse
    views.q.copy_(q); views.draft_kv.copy_(draft_kv)           # or let the model write there
    (result,) = client.verify(layer, [VerifyItem(seq, views.q, views.draft_kv, parents,
                                                 shm=place)])
    # result.out is views.out: bfloat16 [n, H, 512] on cuda:0, written by the server
    client.unregister_cuda_shared_memory("gpu-0")
    region.close()

How the server reaches it: the allocation's cudaIpcMemHandle_t (what
torch's `storage._share_cuda_()` exports: the handle of the whole block
torch's caching allocator got from cudaMalloc, and the storage's offset in
it), registered with RegisterCudaSharedMemory; the server maps it on its
devices and its copy kernels read q/draft_kv and write out/lse there before
it answers.

Device: a region lives on one CUDA device; it is registered under that
device's index as this process numbers it. When the server numbers devices
otherwise (another CUDA_VISIBLE_DEVICES), pass `device_id=` in the server's
numbering. The allocator must be torch's default (cudaMalloc blocks): with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or the cudaMallocAsync
backend there is no cudaIpcMemHandle_t to give, and registration says so.

Streams: before a request that references a region is sent, the client
synchronizes the current torch stream of the region's device, so the work
queued there (kernels that wrote q/draft_kv, or that still read the last
out/lse) has finished. Work on other streams must be finished by the
caller first. When verify returns, out and lse are written (the server's
copies completed before it answered) and may be read from any stream.

Results are views of the region, not copies: the next call that uses the
same placement overwrites them (clone what must outlive it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mlaverify import tensors
from mlaverify.shm import LATENT_DIM, VALUE_DIM, ShmPlacement

# sizeof(cudaIpcMemHandle_t): what RegisterCudaSharedMemory takes.
CUDA_IPC_HANDLE_BYTES = 64
# torch >= 2.4 prefixes the handle with a version byte and a type byte: 'c'
# for a cudaMalloc block (the payload is the cudaIpcMemHandle_t), 'e' for an
# expandable segment (no cudaIpcMemHandle_t at all).
_HANDLE_TYPE_CUDA_MALLOC = ord("c")
_HANDLE_TYPE_EXPANDABLE = ord("e")


def cuda_ipc_handle(shared: bytes) -> bytes:
    """The cudaIpcMemHandle_t bytes in the handle torch's `_share_cuda_()`
    returns: the handle itself (torch < 2.4: 64 bytes) or a version byte, a
    type byte and the handle. ValueError for an expandable segment or a
    format this does not know."""
    shared = bytes(shared)
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) >= 2 and shared[1] == _HANDLE_TYPE_EXPANDABLE:
        raise ValueError("the tensor lies in an expandable segment of torch's allocator, which "
                         "has no cudaIpcMemHandle_t: allocate it with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    if len(shared) == CUDA_IPC_HANDLE_BYTES + 2 and shared[1] == _HANDLE_TYPE_CUDA_MALLOC:
        return shared[2:]
    raise ValueError(f"a CUDA IPC handle of {len(shared)} bytes (type byte "
                     f"{shared[1:2]!r}) from torch: not a cudaIpcMemHandle_t this client knows")


@dataclass(frozen=True)
class ItemViews:
    """Torch views of one placed item in a CUDA region: q bfloat16 [N, H,
    576], draft_kv bfloat16 [N, 576], out bfloat16 [N, H, 512], lse float32
    [N, H]."""

    q: Any
    draft_kv: Any
    out: Any
    lse: Any


def _torch():
    """The torch module; RuntimeError when it is not importable."""
    if not tensors.torch_available():
        raise RuntimeError("CUDA shared memory needs torch")
    return tensors.torch_module()


class CudaSharedMemoryRegion:
    """A range of device memory to register with
    VerifyClient.register_cuda_shared_memory.

    CudaSharedMemoryRegion(size, device) allocates `size` bytes with torch
    on `device` ("cuda:0", an index, a torch.device; None: the current
    device); CudaSharedMemoryRegion.from_tensor(t) takes the memory of an
    existing contiguous CUDA tensor (e.g. buffers the model already writes).
    Offsets (of placements and views) count from the region's first byte.
    """

    def __init__(self, size: int, device: Any = None):
        torch = _torch()
        if size <= 0:
            raise ValueError(f"a CUDA shared-memory region of {size} bytes")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA shared memory needs a CUDA device; torch sees none")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device {device}: a CUDA shared-memory region must be on a CUDA "
                             "device")
        # Zeroed, so that a read before the first answer shows zeros.
        self._attach_tensor(torch.zeros(size, dtype=torch.uint8, device=device))

    @classmethod
    def from_tensor(cls, tensor: Any) -> "CudaSharedMemoryRegion":
        """The memory of `tensor` (contiguous, on a CUDA device) as a region;
        it stays alive as long as the region."""
        torch = _torch()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            raise ValueError("from_tensor: expected a torch tensor on a CUDA device")
        if not tensor.is_contiguous():
            raise ValueError("from_tensor: the tensor must be contiguous")
        region = cls.__new__(cls)
        region._attach_tensor(tensor.view(-1).view(torch.uint8))
        return region

    def _attach_tensor(self, data: Any) -> None:
        """Exports `data`'s allocation (uint8, 1-D, CUDA) by IPC handle."""
        # torch >= 2.0: untyped_storage(); torch 1.13: the TypedStorage's untyped().
        storage = data.untyped_storage() if hasattr(data, "untyped_storage") \
            else data.storage().untyped()
        (device, handle, _size, storage_offset, ref_handle, ref_offset, _event,
         _sync) = storage._share_cuda_()
        release = _ipc_counter_release(ref_handle, ref_offset)
        try:
            raw = cuda_ipc_handle(handle)
        except ValueError:
            release()
            raise
        base = int(storage_offset) + data.storage_offset() * data.element_size()
        self._attach(data, raw, base, int(device), release)

    @classmethod
    def _of(cls, data: Any, raw_handle: bytes, base_offset: int, device_index: int,
            release: Optional[Callable[[], None]] = None) -> "CudaSharedMemoryRegion":
        """A region over `data` (uint8, 1-D) with a given handle: the pieces
        the constructors find, for tests that run without a GPU."""
        region = cls.__new__(cls)
        region._attach(data, raw_handle, base_offset, device_index, release)
        return region

    def _attach(self, data: Any, raw_handle: bytes, base_offset: int, device_index: int,
                release: Optional[Callable[[], None]]) -> None:
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"a cudaIpcMemHandle_t is {CUDA_IPC_HANDLE_BYTES} bytes, not "
                             f"{len(raw_handle)}")
        self._data = data
        self.raw_handle = bytes(raw_handle)
        # Bytes from the start of the exported allocation to the region's
        # first byte: the server maps the allocation from its start, so
        # references carry base_offset + the region's offset.
        self.base_offset = int(base_offset)
        self.device_index = int(device_index)
        self.size = int(data.numel())
        self._release = release
        self._views: dict = {}

    @property
    def device(self) -> Any:
        """The torch.device the region is on."""
        return self._data.device

    @property
    def tensor(self) -> Any:
        """The region as a uint8 tensor (1-D, `size` bytes)."""
        return self._data

    def view(self, offset: int, dtype: Any, shape: Sequence[int]) -> Any:
        """A torch view of the region: `dtype` (torch.bfloat16,
        torch.float32...) of `shape` from byte `offset` (a multiple of the
        dtype's size). The same view object for the same arguments: a
        scheduler places the same items every layer, and the client tells
        an input already in place by its identity."""
        key = (offset, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[key] = self._make_view(offset, dtype, shape)
        return view

    def _make_view(self, offset: int, dtype: Any, shape: Sequence[int]) -> Any:
        torch = _torch()
        count = int(np.prod(shape))
        itemsize = torch.tensor([], dtype=dtype).element_size()
        if offset < 0 or offset % itemsize or offset + count * itemsize > self.size:
            raise ValueError(f"a view of {count} x {dtype} at byte {offset} does not fit a region "
                             f"of {self.size} bytes (or is not aligned to {itemsize})")
        return self._data[offset:offset + count * itemsize].view(dtype).view(*shape)

    def item_views(self, placement: ShmPlacement) -> ItemViews:
        """q, draft_kv, out and lse of `placement` (place_item's) as views."""
        torch = _torch()
        n, num_heads = placement.num_drafts, placement.num_heads
        if n < 1 or num_heads < 1:
            raise ValueError("the placement does not say its N and H (make it with place_item)")
        return ItemViews(
            q=self.view(placement.q_offset, torch.bfloat16, [n, num_heads, LATENT_DIM]),
            draft_kv=self.view(placement.draft_kv_offset, torch.bfloat16, [n, LATENT_DIM]),
            out=self.view(placement.out_offset, torch.bfloat16, [n, num_heads, VALUE_DIM]),
            lse=self.view(placement.lse_offset, torch.float32, [n, num_heads]))

    def close(self) -> None:
        """Lets torch reuse the memory once this process frees it.
        Unregister the region from the server first: the server keeps its
        mapping until then."""
        if self._release is not None:
            self._release()
            self._release = None
        self._data = None
        self._views = {}

    def __enter__(self) -> "CudaSharedMemoryRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ipc_counter_release(handle: Any, offset: Any) -> Callable[[], None]:
    """What gives back the reference `_share_cuda_` counted for the receiver:
    torch keeps an exported block out of its cache while that count is
    non-zero (the server, not being torch, never decrements it)."""
    def release() -> None:
        torch = _torch()
        storage_cls = getattr(torch, "UntypedStorage", None) or torch._UntypedStorage
        storage_cls._release_ipc_counter_cuda(handle, offset)
    return release


class CudaRegisteredView:
    """A registered CUDA region as the request builder uses it: inputs are
    copied to the device unless they already are the placement's memory;
    outputs are views."""

    outputs_are_views = True  # read() returns the same view for the same place
    writes_are_queued = True  # a write is queued on the current stream

    def __init__(self, region: CudaSharedMemoryRegion):
        self.region = region
        self._view = region.view
        self._stream: Optional[tuple] = None  # (raw handle, torch Stream) of the last prepare

    def write(self, offset: int, value: Any, shape: Sequence[int], what: str) -> int:
        """Puts bf16 `value` (a torch.bfloat16 tensor, CPU or CUDA, or uint16
        bits) at `offset` on the current stream; returns its byte size."""
        torch = _torch()
        dst = self._view(offset, torch.bfloat16, shape)
        if self.in_place(offset, value, shape):
            return dst.numel() * 2  # the placement's own view: already in place
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.bfloat16:
                raise TypeError(f"{what}: expected a torch.bfloat16 tensor, got {value.dtype}")
            if list(value.shape) != list(shape):
                raise ValueError(f"{what}: expected shape {list(shape)}, got {list(value.shape)}")
            if value.device == dst.device and value.data_ptr() == dst.data_ptr() and \
                    value.is_contiguous():
                return dst.numel() * 2  # already in place
            dst.copy_(value)
        else:
            bits = tensors.as_bits(value, tensors.BF16, shape, what)
            dst.copy_(tensors.numpy_to_torch(np.ascontiguousarray(bits)))
        return dst.numel() * 2

    def in_place(self, offset: int, value: Any, shape: Sequence[int]) -> bool:
        """Whether `value` is the placement's own view at `offset` (so a
        write of it copies nothing)."""
        return value is self._view(offset, _torch().bfloat16, shape)

    def ref_offset(self, offset: int) -> int:
        """The offset a SharedMemoryRef carries: from the allocation's start."""
        return self.region.base_offset + offset

    def prepare(self) -> None:
        """Waits for the device's current stream (the copies in, and any
        reader of the last outputs)."""
        if not self.region.tensor.is_cuda:
            return
        torch = _torch()
        index = self.region.device_index
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            torch.cuda.current_stream(index).synchronize()
            return
        # current_stream() builds a Stream object per call (~3 us, several
        # times that between gRPC calls): the last one is kept while the
        # current stream's handle stays the same.
        handle = raw(index)
        last = self._stream
        if last is None or last[0] != handle:
            last = self._stream = (handle, torch.cuda.current_stream(index))
        last[1].synchronize()

    def read(self, ref_offset: int, dtype: str, shape: Sequence[int], output: Any) -> Any:
        """A view of the output a SharedMemoryRef places at `ref_offset`
        (torch, on the region's device)."""
        torch = _torch()
        return self._view(ref_offset - self.region.base_offset,
                          torch.bfloat16 if dtype == tensors.BF16 else torch.float32, shape)
