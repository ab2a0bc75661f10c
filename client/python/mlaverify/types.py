"""Typed results of the informational RPCs: dataclasses with the proto's
field names, so `info.num_layers` reads the same as on the message and a
type checker sees every field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Type, TypeVar

from mlaverify.v1 import verify_pb2

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the server."""

    name: str = ""
    memory_bytes: int = 0


@dataclass(frozen=True)
class PoolInfo:
    """Page accounting of one KV pool (one per device in "dp" mode)."""

    devices: str = ""
    total_pages: int = 0
    free_pages: int = 0
    live_sequences: int = 0


@dataclass(frozen=True)
class ServerInfo:
    """GetServerInfo's answer (proto/mlaverify/v1/verify.proto, ServerInfo,
    says what each field means)."""

    version: str = ""
    backend: str = ""
    devices: List[DeviceInfo] = field(default_factory=list)
    num_layers: int = 0
    num_heads: int = 0
    latent_dim: int = 0
    value_dim: int = 0
    rope_dim: int = 0
    page_size: int = 0
    total_pages: int = 0
    free_pages: int = 0
    max_draft_len: int = 0
    draft_buckets: List[int] = field(default_factory=list)
    batch_buckets: List[int] = field(default_factory=list)
    max_batch: int = 0
    max_message_bytes: int = 0
    default_softmax_scale: float = 0.0
    idle_timeout_seconds: int = 0
    live_sequences: int = 0
    max_sequence_len: int = 0
    parallel_mode: str = ""
    heads_per_device: int = 0
    pools: List[PoolInfo] = field(default_factory=list)
    cuda_graphs: bool = False
    max_queued_calls: int = 0
    max_queued_bytes: int = 0
    max_live_sequences: int = 0
    instance_id: str = ""
    verify_calls_timed: int = 0
    verify_server_seconds_total: float = 0.0
    verify_queue_seconds_total: float = 0.0
    verify_device_seconds_total: float = 0.0
    client_shared_memory: bool = False
    kv_dtype: str = ""
    kv_row_bytes: int = 0
    step_lanes_per_device: int = 0
    step_layer_timeout_ms: int = 0
    step_max_duration_ms: int = 0
    host_doorbells: bool = False
    gpu_doorbells: bool = False


@dataclass(frozen=True)
class SystemSharedMemoryStatus:
    """One registered region (either kind) as SystemSharedMemoryStatus lists it."""

    name: str = ""
    key: str = ""
    offset: int = 0
    byte_size: int = 0
    calls_in_flight: int = 0
    calls_total: int = 0
    pinned: bool = False
    cuda: bool = False
    device_id: int = 0


@dataclass(frozen=True)
class CudaSharedMemoryStatus:
    """One registered CUDA region as CudaSharedMemoryStatus lists it."""

    name: str = ""
    device_id: int = 0
    byte_size: int = 0
    calls_in_flight: int = 0
    calls_total: int = 0


@dataclass(frozen=True)
class StepStatus:
    """A device-driven step as AbortStep and GetStep describe it: its state
    (running, layers_done, aborting, committed, aborted), layers done on every
    rank, items committed, and for an aborted step why (abort_reason, and
    error_code in google.rpc.Code numbering with error_message)."""

    step_id: int = 0
    state: str = ""
    num_layers: int = 0
    layers_done: int = 0
    items: int = 0
    items_committed: int = 0
    abort_reason: str = ""
    error_code: int = 0
    error_message: str = ""


_NESTED = {"devices": DeviceInfo, "pools": PoolInfo}


def from_message(cls: Type[T], message: Any) -> T:
    """A dataclass of `cls` from a protobuf message with the same field names
    (repeated fields as lists; nested messages converted by field name)."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(message, f.name)
        nested = _NESTED.get(f.name) if cls is ServerInfo else None
        if nested is not None:
            value = [from_message(nested, m) for m in value]
        elif f.default_factory is not dataclasses.MISSING:  # repeated scalars
            value = list(value)
        values[f.name] = value
    return cls(**values)


def server_info(message: verify_pb2.ServerInfo) -> ServerInfo:
    """ServerInfo from GetServerInfo's message."""
    return from_message(ServerInfo, message)
