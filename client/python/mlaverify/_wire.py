"""What the synchronous and the asyncio clients share: geometry, client-side
checks, request building and response decoding. No I/O here."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

import grpc

from mlaverify import tensors
from mlaverify._channels import IDEMPOTENT, RETRYABLE, ConnectionPool, retry_delays
from mlaverify.errors import VerifyError, code_from_number
from mlaverify.shm import ShmPlacement
from mlaverify.v1 import verify_pb2, verify_pb2_grpc

LATENT_DIM = 576
VALUE_DIM = 512
APPEND_MESSAGE_CAP = 16 << 20


@dataclass
class VerifyItem:
    """One sequence's drafts for one layer.

    q: bf16 [N, num_heads, 576] (uint16 bits or torch.bfloat16);
    draft_kv: bf16 [N, 576]; parents: N ints, each -1 or an earlier index.
    """

    sequence_id: int
    q: Any
    draft_kv: Any
    parents: Sequence[int]
    # Not None: the shared-memory plane for this item (a region registered
    # with register_system_shared_memory): q and draft_kv are copied into
    # the placement and sent as references, out and lse come back there.
    shm: Optional[ShmPlacement] = None


@dataclass
class VerifyResult:
    """out: bf16 [N, num_heads, 512]; lse: fp32 [N, num_heads], natural log;
    prefix_len: the committed length the drafts attended to."""

    sequence_id: int
    out: Any
    lse: Any
    prefix_len: int


@dataclass
class CommitResult:
    length: int
    accepted_count: int


def prompt_tokens(kv: Any) -> int:
    """T of a prompt's kv [num_layers, T, 576]; ValueError for another shape."""
    shape = tensors.shape_of(kv)
    if len(shape) != 3 or shape[1] < 1:
        raise ValueError(f"kv: expected shape [num_layers, T >= 1, 576], got {list(shape)}")
    return shape[1]


def check_parents(parents: Sequence[int], max_draft_len: int, what: str) -> List[int]:
    """`parents` as ints, checked to be a forest of 1..max_draft_len drafts
    with every parent before its child; ValueError naming `what` if not."""
    p = [int(x) for x in parents]
    if not 1 <= len(p) <= max_draft_len:
        raise ValueError(f"{what}: {len(p)} drafts, the server takes 1..{max_draft_len}")
    for i, parent in enumerate(p):
        if not -1 <= parent < i:
            raise ValueError(f"{what}: parents[{i}] = {parent}, must be -1 or in 0..{i - 1}")
    return p


def check_path(accepted: Sequence[int], what: str) -> List[int]:
    """`accepted` as ints, none negative (the server checks it is a root
    path of the pending tree)."""
    a = [int(x) for x in accepted]
    if any(x < 0 for x in a):
        raise ValueError(f"{what}: accepted indices must be >= 0, got {a}")
    return a


class Geometry:
    """The parts of ServerInfo the client checks requests against."""

    def __init__(self, info: Any, regions: dict):
        self.info = info
        # Registered region name -> this process's SharedMemoryRegion.
        self.regions = regions
        self.num_layers = info.num_layers
        self.num_heads = info.num_heads
        self.max_draft_len = info.max_draft_len
        self.max_batch = info.max_batch
        self.max_message_bytes = info.max_message_bytes
        self.default_softmax_scale = info.default_softmax_scale
        # Placed items' messages by placement, sequence and tree (see verify_request).
        self._placed_items: dict = {}

    def append_request(self, sequence_id: int, start_position: int, kv: Any) -> verify_pb2.AppendKvRequest:
        """An AppendKvRequest of bf16 kv [num_layers, T >= 1, 576], checked."""
        tensor = tensors.to_proto(kv, tensors.BF16, [self.num_layers, -1, LATENT_DIM], "kv")
        if tensor.shape[1] < 1:
            raise ValueError("kv: needs at least one token")
        return verify_pb2.AppendKvRequest(sequence_id=sequence_id, start_position=start_position,
                                          kv=tensor)

    def prompt_chunk_tokens(self) -> int:
        """Tokens per AppendKv chunk that keep a request under the server's
        message limit (with room for the message's own fields) and under
        16 MiB, which uploads faster than larger messages (as the C++
        client's kAppendKvMessageCap)."""
        per_token = self.num_layers * LATENT_DIM * 2
        limit = min(self.max_message_bytes, APPEND_MESSAGE_CAP)
        if limit - 4096 < per_token:
            limit = self.max_message_bytes
        return max(1, (limit - 4096) // per_token)

    def verify_request(self, layer: int, items: Sequence[VerifyItem], softmax_scale: float,
                       request_id: int) -> verify_pb2.VerifyRequest:
        """A VerifyRequest of `items`, every dimension checked against the
        server's geometry (ValueError/TypeError naming the item); items
        placed in shared memory have their q and draft_kv written there."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer}: the server has layers 0..{self.num_layers - 1}")
        if not 1 <= len(items) <= self.max_batch:
            raise ValueError(f"{len(items)} items, the server takes 1..{self.max_batch} per Verify")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale {softmax_scale} is not finite")
        seen = set()
        placed = set()  # regions this request's inputs were written into
        request = verify_pb2.VerifyRequest(layer=layer, softmax_scale=softmax_scale,
                                           request_id=request_id)
        for k, item in enumerate(items):
            what = f"items[{k}] (sequence {item.sequence_id})"
            if item.sequence_id in seen:
                raise ValueError(f"{what}: sequence twice in one Verify")
            seen.add(item.sequence_id)
            parents = check_parents(item.parents, self.max_draft_len, what)
            n = len(parents)
            q_shape, kv_shape = [n, self.num_heads, LATENT_DIM], [n, LATENT_DIM]
            if item.shm is None:
                request.items.append(verify_pb2.VerifyItem(
                    sequence_id=item.sequence_id,
                    q=tensors.to_proto(item.q, tensors.BF16, q_shape, f"{what} q"),
                    draft_kv=tensors.to_proto(item.draft_kv, tensors.BF16, kv_shape,
                                              f"{what} draft_kv"),
                    parents=parents))
                continue
            p = item.shm
            region = self._region(p.region, what)
            region.write(p.q_offset, item.q, q_shape, f"{what} q")
            region.write(p.draft_kv_offset, item.draft_kv, kv_shape, f"{what} draft_kv")
            # Only references travel, and a step repeats them on every layer:
            # the item's message is built once per (region, placement,
            # sequence, tree).
            key = (region.ref_offset(0), p.region, p.q_offset, p.draft_kv_offset, p.out_offset,
                   p.lse_offset, item.sequence_id, tuple(parents))
            wire = self._placed_items.get(key)
            if wire is None:
                if len(self._placed_items) >= 4096:
                    self._placed_items.clear()
                wire = self._placed_items[key] = self._placed_item(
                    region, p, item.sequence_id, parents, q_shape, kv_shape)
            placed.add(p.region)
            request.items.append(wire)
        for name in placed:
            # CUDA regions: the inputs were written on the device's current
            # stream; the server reads them once the request arrives.
            self.regions[name].prepare()
        return request

    def _placed_item(self, region, p: ShmPlacement, sequence_id: int, parents: List[int],
                     q_shape: List[int], kv_shape: List[int]) -> verify_pb2.VerifyItem:
        """The VerifyItem message of an item placed at `p` in `region`."""
        n = len(parents)
        wire = verify_pb2.VerifyItem(sequence_id=sequence_id, parents=parents)
        for field, shape, offset in (("q", q_shape, p.q_offset),
                                     ("draft_kv", kv_shape, p.draft_kv_offset)):
            tensor = getattr(wire, field)
            tensor.dtype = verify_pb2.DTYPE_BF16
            tensor.shape.extend(shape)
            tensor.shared_memory.CopyFrom(verify_pb2.SharedMemoryRef(
                region=p.region, offset=region.ref_offset(offset),
                byte_size=int(np.prod(shape)) * 2))
        wire.out_shared_memory.CopyFrom(verify_pb2.SharedMemoryRef(
            region=p.region, offset=region.ref_offset(p.out_offset),
            byte_size=n * self.num_heads * VALUE_DIM * 2))
        wire.lse_shared_memory.CopyFrom(verify_pb2.SharedMemoryRef(
            region=p.region, offset=region.ref_offset(p.lse_offset),
            byte_size=n * self.num_heads * 4))
        return wire

    def _region(self, name: str, what: str):
        region = self.regions.get(name)
        if region is None:
            raise ValueError(f"{what}: shared-memory region {name!r} was not registered "
                             "through this client (register_system_shared_memory)")
        return region

    def _placed_output(self, wanted: verify_pb2.SharedMemoryRef, got: verify_pb2.Tensor,
                       dtype: str, shape, what: str, output: "tensors.Output"):
        ref = got.shared_memory
        if got.WhichOneof("data") != "shared_memory" or ref.offset != wanted.offset or \
                ref.region != wanted.region or ref.byte_size != wanted.byte_size:
            raise ValueError(f"{what}: the server answered it elsewhere than it was placed")
        if got.shape != shape:
            raise ValueError(f"{what}: shape {list(got.shape)}, expected {list(shape)}")
        region = self._region(wanted.region, what)
        return region.read(wanted.offset, dtype, shape, output)

    def verify_results(self, request: verify_pb2.VerifyRequest, response: verify_pb2.VerifyResponse,
                       output: "tensors.Output") -> List[VerifyResult]:
        """The results of `request` decoded from `response` (raw bytes, or
        the placed outputs read from their regions), checked against what
        was asked; ValueError when the answer does not fit the request."""
        if len(response.results) != len(request.items):
            raise ValueError(f"the server answered {len(response.results)} results for "
                             f"{len(request.items)} items")
        results = []
        for item, r in zip(request.items, response.results):
            if r.sequence_id != item.sequence_id:
                raise ValueError(f"result for sequence {r.sequence_id} where {item.sequence_id} "
                                 "was asked")
            n = len(item.parents)
            if item.HasField("out_shared_memory"):
                out = self._placed_output(item.out_shared_memory, r.out, tensors.BF16,
                                          [n, self.num_heads, VALUE_DIM], "out", output)
                lse = self._placed_output(item.lse_shared_memory, r.lse, tensors.FP32,
                                          [n, self.num_heads], "lse", output)
            else:
                out = tensors.from_proto(r.out, tensors.BF16, [n, self.num_heads, VALUE_DIM],
                                         "out", output)
                lse = tensors.from_proto(r.lse, tensors.FP32, [n, self.num_heads], "lse",
                                         output)
            results.append(VerifyResult(sequence_id=r.sequence_id, out=out, lse=lse,
                                        prefix_len=r.prefix_len))
        return results


class RegisteredView:
    """A registered range of a SharedMemoryRegion (system shared memory):
    offsets count from the range's start. Inputs are copied in; outputs are
    copied out (the region is reused by the next call)."""

    outputs_are_views = False  # read() copies
    writes_are_queued = False  # a write is a host copy, done when it returns

    def __init__(self, region, offset: int):
        self._region, self._offset = region, offset

    def write(self, offset: int, value: Any, shape: Sequence[int], what: str) -> int:
        """Copies bf16 `value` (checked against `shape`) in at `offset`;
        returns its byte size."""
        values = tensors.as_bits(value, tensors.BF16, shape, what)
        self._region.array(self._offset + offset, np.uint16, shape)[...] = values
        return values.nbytes

    def in_place(self, offset: int, value: Any, shape: Sequence[int]) -> bool:
        """Never: a write copies `value` in (the caller may have changed it)."""
        return False

    def ref_offset(self, offset: int) -> int:
        """The offset a SharedMemoryRef carries for `offset`."""
        return offset

    def prepare(self) -> None:
        """Nothing to wait for: the copies in were made by this thread."""

    def read(self, ref_offset: int, dtype: str, shape: Sequence[int],
             output: "tensors.Output") -> Any:
        """A copy of the output a SharedMemoryRef places at `ref_offset`, as
        `output` says."""
        np_dtype = np.uint16 if dtype == tensors.BF16 else np.float32
        values = self._region.array(self._offset + ref_offset, np_dtype, shape)
        if not (output.float32 and np_dtype == np.uint16):
            values = values.copy()  # widening copies already
        return tensors.deliver(values, output)


def register_request(name: str, region, offset: int,
                     byte_size: Optional[int]) -> verify_pb2.RegisterSystemSharedMemoryRequest:
    """The RegisterSystemSharedMemoryRequest of [offset, offset + byte_size)
    of `region` (byte_size None: to its end)."""
    byte_size = region.size - offset if byte_size is None else byte_size
    return verify_pb2.RegisterSystemSharedMemoryRequest(name=name, key=region.key, offset=offset,
                                                        byte_size=byte_size)


def unknown_answer(response: verify_pb2.VerifyResponse) -> VerifyError:
    """The failure of a stream that answered a request_id nobody asked."""
    return VerifyError(grpc.StatusCode.INTERNAL,
                       f"an answer for unknown request_id {response.request_id}", "VerifyStream")


def settle_answer(future, geometry: "Geometry", request: verify_pb2.VerifyRequest,
                  response: verify_pb2.VerifyResponse, output: "tensors.Output") -> None:
    """Completes a stream request's future (concurrent or asyncio) with its
    results, its in-band error, or the reason its answer is malformed."""
    if response.error_code != 0:
        future.set_exception(VerifyError(code_from_number(response.error_code),
                                         response.error_message, "VerifyStream"))
        return
    try:
        future.set_result(geometry.verify_results(request, response, output))
    except ValueError as e:
        future.set_exception(VerifyError(grpc.StatusCode.INTERNAL, str(e), "VerifyStream"))


def stream_end_failure(failure, pending: bool):
    """Why pending requests fail when a stream ended (None: nothing pending
    and no failure)."""
    if failure is None and pending:
        return VerifyError(grpc.StatusCode.UNAVAILABLE, "the stream ended with requests unanswered",
                           "VerifyStream")
    return failure


class ClientBase:
    """What VerifyClient and AsyncVerifyClient share: the connection pool
    (plain or asyncio channels), the stubs of each connection, the output
    format and the registered regions."""

    def __init__(self, target: str, pool: ConnectionPool, auth_token: Optional[str],
                 timeout: Optional[float], output: tensors.Output, retries: int,
                 retry_backoff_s: float):
        if retries < 0 or retry_backoff_s < 0:
            raise ValueError(f"retries {retries} and retry_backoff_s {retry_backoff_s}: "
                             "need both >= 0")
        self._pool = pool
        self._stubs = [verify_pb2_grpc.VerifyServiceStub(c) for c in pool.channels]
        self._healths = [c.unary_unary(HEALTH_CHECK) for c in pool.channels]
        self._channel = pool.channels[0]
        self._stub = self._stubs[0]
        self._metadata = metadata(auth_token)
        self._timeout = timeout
        self._output = output
        self._retries = retries
        self._retry_backoff_s = retry_backoff_s
        self._wait_for_ready = pool.settings.wait_for_ready
        self._geometry: Optional[Geometry] = None
        # Registered name -> its view (RegisteredView, or a CUDA region's);
        # shared with the geometry.
        self._regions: dict = {}
        self._request_ids = itertools.count(1)
        self.target = target

    @property
    def connections(self) -> int:
        """How many HTTP/2 connections this client spreads its calls over."""
        return len(self._pool)

    def _connection(self, sequence_id: Optional[int]) -> int:
        if sequence_id is None:
            return self._pool.next()
        return self._pool.for_sequence(sequence_id)

    def _attempts(self, rpc: str) -> List[Optional[float]]:
        """None (the first try), then the waits before each retry; retries
        only for the RPCs that change nothing."""
        if rpc not in IDEMPOTENT:
            return [None]
        return [None] + list(retry_delays(self._retries, self._retry_backoff_s))

    @staticmethod
    def _retryable(rpc: str, error: VerifyError) -> bool:
        return rpc in IDEMPOTENT and error.code in RETRYABLE

    def _call_metadata(self, extra: "Metadata"):
        """What a call with the caller's `extra` metadata sends (merge_metadata)."""
        return merge_metadata(self._metadata, extra)


def metadata(auth_token: Optional[str]):
    """The call metadata that carries `auth_token` (None: none)."""
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else None


# A caller's metadata for one call: (key, value) pairs, as grpcio takes them.
Metadata = Optional[Sequence[Tuple[str, str]]]


def merge_metadata(own: Optional[Tuple[Tuple[str, str], ...]], extra: Metadata):
    """The metadata one call sends: the client's own (its token's
    "authorization") with the caller's pairs for this call. A key the caller
    gives replaces every pair of the client's with that key (compared
    without case, as HTTP/2 header names are): two "authorization" values
    would reach the server as a list, and which one it checks would be up
    to it. A key repeated within `extra` is sent repeated, as given."""
    if not extra:
        return own
    if isinstance(extra, (str, bytes, dict)):
        raise TypeError(f"metadata: expected a sequence of (key, value) pairs, got "
                        f"{type(extra).__name__}")
    pairs = []
    for pair in extra:
        if isinstance(pair, (str, bytes)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(f"metadata: expected (key, value) pairs with str keys, got {pair!r}")
        pairs.append((pair[0], pair[1]))
    replaced = {key.lower() for key, _ in pairs}
    return tuple(p for p in own or () if p[0].lower() not in replaced) + tuple(pairs)


# grpc.health.v1 by hand: the request is an empty message (service ""), the
# response's field 1 is the status enum. Generating the health stubs here
# would register grpc.health.v1 a second time next to grpcio-health-checking.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


# Codes that say the server could not be reached in time (is_serving: not
# serving, rather than an error).
UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _varint(data: bytes, i: int) -> Tuple[int, int]:
    """The varint at data[i:] and the index after it; ValueError when it is
    cut short or longer than protobuf's 10 bytes."""
    value = 0
    for shift in range(0, 70, 7):
        if i >= len(data):
            raise ValueError(f"health response truncated in a varint at byte {i}")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
    raise ValueError(f"health response: a varint longer than 10 bytes ending at byte {i}")


def decode_health(response: bytes) -> str:
    """A grpc.health.v1 HealthCheckResponse's status name ("SERVING"...).

    Fields other than 1 (status) are skipped, whatever their wire type, as a
    generated parser keeps them as unknown: a server whose health message
    grew a field must not break the clients. Only malformed input raises
    ValueError: a field cut short, field number 0, or wire types 3, 4
    (groups, which proto3 has no use for) and 6, 7 (undefined)."""
    status, i = 0, 0
    while i < len(response):
        tag, i = _varint(response, i)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise ValueError(f"health response: field number 0 at byte {i}")
        if wire_type == 0:
            value, i = _varint(response, i)
            if field == 1:
                # An enum is an int32 sent sign-extended to 64 bits; the last
                # occurrence wins, as in any protobuf parser.
                status = value - (1 << 64) if value >= 1 << 63 else value
            continue
        # A field 1 of another wire type is not the status: protobuf parsers
        # keep such a field as unknown, and so it is skipped here.
        if wire_type == 1:
            size = 8
        elif wire_type == 5:
            size = 4
        elif wire_type == 2:
            size, i = _varint(response, i)
        else:
            raise ValueError(f"health response: field {field} has wire type {wire_type}, "
                             "which is not 0, 1, 2 or 5")
        if i + size > len(response):
            raise ValueError(f"health response truncated in field {field} ({size} bytes from "
                             f"byte {i}, {len(response) - i} left)")
        i += size
    return HEALTH_STATUS.get(status, f"UNKNOWN({status})")
