"""Tensors on the wire: NumPy arrays (and torch tensors) to and from
``mlaverify.v1.Tensor``.

bf16 has no NumPy dtype, so bf16 data is carried as ``uint16`` arrays holding
the raw bf16 bits; ``bf16_from_float32`` and ``float32_from_bf16`` convert.
When torch is importable, ``torch.bfloat16`` tensors are accepted wherever a
bf16 array is, and results can be returned as torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from mlaverify.v1 import verify_pb2

try:  # torch is optional
    import torch as _torch
except ImportError:  # pragma: no cover - depends on the machine
    _torch = None

BF16 = "bf16"
FP32 = "fp32"
_ITEM_BYTES = {BF16: 2, FP32: 4}
_PROTO_DTYPE = {BF16: verify_pb2.DTYPE_BF16, FP32: verify_pb2.DTYPE_FP32}


def torch_available() -> bool:
    """Whether torch is importable here."""
    return _torch is not None


def torch_module() -> Any:
    """The torch module (None when it is not importable)."""
    return _torch


@dataclass(frozen=True)
class Output:
    """How results are handed back: NumPy (uint16 bf16 bits, float32) when
    `torch` is False, else torch tensors (bfloat16, float32) on `device`
    (None: the CPU). `float32`: the bf16 outputs widened to float32 (exact),
    NumPy or torch alike. Results placed in a CUDA region are torch views of
    it whatever this says."""

    torch: bool = False
    device: Optional[Any] = None
    float32: bool = False

    @staticmethod
    def of(as_torch: bool, device: Any = None, as_float32: bool = False) -> "Output":
        """The format for a client's as_torch/device/as_float32 arguments: a
        device implies torch tensors."""
        if (as_torch or device is not None) and _torch is None:
            raise RuntimeError("torch results were asked for (as_torch/device) but torch is "
                               "not importable")
        if device is not None:
            return Output(True, _torch.device(device), bool(as_float32))
        return Output(bool(as_torch), None, bool(as_float32))


def bf16_from_float32(x: Any) -> np.ndarray:
    """float32 values -> bf16 bits (uint16), rounded to nearest even.

    NaN stays NaN (a quiet NaN of the same sign); infinities stay infinite.
    """
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = f.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def float32_from_bf16(bits: Any) -> np.ndarray:
    """bf16 bits (uint16) -> float32 values (exact)."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {b.dtype}")
    return (b.astype(np.uint32) << 16).view(np.float32)


def _is_torch(x: Any) -> bool:
    """Whether `x` is a torch tensor."""
    return _torch is not None and isinstance(x, _torch.Tensor)


def _as_numpy(x: Any, dtype: str, what: str) -> np.ndarray:
    """A C-contiguous NumPy view (no copy where the input allows) of the
    wire dtype: uint16 bits for bf16, float32 for fp32."""
    if _is_torch(x):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if dtype == BF16:
            if t.dtype != _torch.bfloat16:
                raise TypeError(f"{what}: expected a torch.bfloat16 tensor, got {t.dtype}")
            # torch 1.13 has no uint16: view the bits as int16, then as uint16.
            return t.view(_torch.int16).numpy().view(np.uint16)
        if t.dtype != _torch.float32:
            raise TypeError(f"{what}: expected a torch.float32 tensor, got {t.dtype}")
        return t.numpy()
    a = np.asarray(x)
    want = np.uint16 if dtype == BF16 else np.float32
    if a.dtype != want:
        hint = " (bf16 travels as uint16 bits: use bf16_from_float32)" if dtype == BF16 else ""
        raise TypeError(f"{what}: expected a {np.dtype(want).name} array, got {a.dtype}{hint}")
    return np.ascontiguousarray(a)


def as_bits(x: Any, dtype: str, shape: Sequence[int], what: str) -> np.ndarray:
    """`x` as a C-contiguous NumPy array of the wire dtype, checked against
    `shape` (every dimension; -1 matches any)."""
    a = _as_numpy(x, dtype, what)
    if a.ndim != len(shape) or any(s != -1 and s != d for s, d in zip(shape, a.shape)):
        raise ValueError(f"{what}: expected shape {_shape_text(shape)}, got {list(a.shape)}")
    return a


def to_proto(x: Any, dtype: str, shape: Sequence[int], what: str) -> verify_pb2.Tensor:
    """Checks `x` against `shape` (every dimension; -1 matches any) and packs
    it into a Tensor with raw bytes (one copy, into the message)."""
    a = as_bits(x, dtype, shape, what)
    return verify_pb2.Tensor(dtype=_PROTO_DTYPE[dtype], shape=list(a.shape), raw=a.tobytes())


def numpy_to_torch(a: np.ndarray) -> Any:
    """A NumPy array (uint16 bf16 bits or float32) as a CPU torch tensor
    (bfloat16 or float32) sharing its memory."""
    if _torch is None:
        raise RuntimeError("torch is not importable")
    if a.dtype == np.uint16:
        return _torch.from_numpy(a.view(np.int16)).view(_torch.bfloat16)
    return _torch.from_numpy(a)


def deliver(a: np.ndarray, output: Output) -> Any:
    """A writable NumPy array (uint16 bf16 bits or float32) as `output`
    says: as it is, or a torch tensor sharing its memory (CPU), or a copy on
    output.device; bf16 bits widened to float32 first when output.float32."""
    if output.float32 and a.dtype == np.uint16:
        a = float32_from_bf16(a)
    if not output.torch:
        return a
    t = numpy_to_torch(a)
    return t if output.device is None else t.to(output.device)


def from_proto(t: verify_pb2.Tensor, dtype: str, shape: Sequence[int], what: str,
               output: Output = Output()) -> Any:
    """A Tensor's raw bytes as a read-only NumPy array of `shape` (no copy),
    or a torch tensor (one copy: torch needs writable memory; on
    output.device when it names one)."""
    if t.WhichOneof("data") != "raw":
        raise ValueError(f"{what}: the server sent no raw bytes")
    if t.dtype != _PROTO_DTYPE[dtype]:
        raise ValueError(f"{what}: dtype {t.dtype}, expected {dtype}")
    if list(t.shape) != list(shape):
        raise ValueError(f"{what}: shape {list(t.shape)}, expected {list(shape)}")
    want = int(np.prod(shape)) * _ITEM_BYTES[dtype]
    if len(t.raw) != want:
        raise ValueError(f"{what}: {len(t.raw)} bytes, expected {want}")
    a = np.frombuffer(t.raw, dtype=np.uint16 if dtype == BF16 else np.float32).reshape(shape)
    if isinstance(output, bool):
        output = Output.of(output)
    if output.float32 and a.dtype == np.uint16:
        return deliver(a, output)  # widening copies
    if not output.torch:
        return a
    return deliver(a.copy(), output)


def _shape_text(shape: Sequence[int]) -> str:
    """[2, *, 576] for a shape with -1 for any."""
    return "[" + ", ".join("*" if s == -1 else str(s) for s in shape) + "]"


def shape_of(x: Any) -> Tuple[int, ...]:
    """The shape of an array, a tensor or a nested list."""
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.asarray(x).shape)
