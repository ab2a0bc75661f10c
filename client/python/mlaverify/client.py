"""The synchronous client: one typed method per RPC, and VerifyStream, a
pipelined per-scheduler stream of Verify requests."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import grpc

from mlaverify import _wire, cuda_shm, native, shm, steps, tensors, types
from mlaverify._channels import DEFAULT_MAX_MESSAGE_BYTES, ChannelSettings, ConnectionPool
from mlaverify._wire import Metadata
from mlaverify.errors import VerifyError, from_rpc_error
from mlaverify.v1 import verify_pb2

_END = object()  # ends a VerifyStream's request iterator


class VerifyClient(_wire.ClientBase):
    """A client of one mlaverify server.

    target: "host:port". credentials: grpc.ssl_channel_credentials(...) for
    TLS/mTLS (None: plaintext). auth_token: the server's --auth-token-file
    contents, sent as a bearer token. timeout: seconds per call (None: no
    deadline). Results: NumPy (uint16 bf16 bits, float32) by default;
    as_torch=True gives torch CPU tensors, device="cuda:0" torch tensors on
    that device (items placed in a CUDA region come back as views of it
    either way); as_float32=True widens `out` from bf16 to float32 (exact),
    as tritonclient hands results back, NumPy or torch alike.

    connections, keepalive_time_s, keepalive_timeout_s,
    keepalive_permit_without_calls, wait_for_ready, max_message_bytes: the
    channels (mlaverify.ChannelSettings says what each does); a sequence's
    calls stay on one connection. retries, retry_backoff_s: how often and
    after how long an UNAVAILABLE is retried, for the calls that change
    nothing (health, server_info, the status calls); no other call is
    retried, since one that failed on the way back may have run. options:
    more channel arguments, appended.

    Every method that makes an RPC takes metadata=: (key, value) pairs sent
    with that call besides the client's own (the auth token's
    "authorization"); a key given there replaces the client's pairs of that
    key, so metadata=[("authorization", "Bearer other")] sends that token
    alone.
    """

    def __init__(self, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                 auth_token: Optional[str] = None, timeout: Optional[float] = 30.0,
                 as_torch: bool = False, device: Any = None, as_float32: bool = False,
                 connections: int = 1,
                 keepalive_time_s: Optional[float] = 30.0, keepalive_timeout_s: float = 10.0,
                 keepalive_permit_without_calls: bool = False, wait_for_ready: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, retries: int = 2,
                 retry_backoff_s: float = 0.05, options: Sequence[Tuple[str, Any]] = ()):
        settings = ChannelSettings(connections, keepalive_time_s, keepalive_timeout_s,
                                   keepalive_permit_without_calls, max_message_bytes,
                                   wait_for_ready, tuple(options or ()))
        pool = ConnectionPool(settings, lambda opts: (
            grpc.secure_channel(target, credentials, opts) if credentials
            else grpc.insecure_channel(target, opts)))
        super().__init__(target, pool, auth_token, timeout,
                         tensors.Output.of(as_torch, device, as_float32), retries, retry_backoff_s)
        self._credentials = credentials
        self._native: Optional[native.NativeClient] = None
        self._native_lock = threading.Lock()
        self._closed = False

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Closes every connection (calls in flight are cancelled)."""
        with self._native_lock:
            if self._native is not None:
                self._native.close()
                self._native = None
            self._closed = True
        for channel in self._pool.channels:
            channel.close()

    def __enter__(self) -> "VerifyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, rpc: str, method: str, request, timeout=None, sequence_id=None,
              metadata: Metadata = None):
        stub = self._stubs[self._connection(sequence_id)]
        sent = self._call_metadata(metadata)
        error = None
        for delay in self._attempts(rpc):
            if delay is not None:
                time.sleep(delay)
            try:
                return getattr(stub, method)(
                    request, timeout=timeout if timeout is not None else self._timeout,
                    metadata=sent, wait_for_ready=self._wait_for_ready)
            except grpc.RpcError as e:
                error = from_rpc_error(e, rpc)
                if not self._retryable(rpc, error):
                    break
        raise error

    # -- RPCs ---------------------------------------------------------------
    def health(self, timeout: Optional[float] = None, *, metadata: Metadata = None) -> str:
        """grpc.health.v1 Check of the whole server: "SERVING", "NOT_SERVING"..."""
        return self._health(timeout, self._attempts("Health.Check"), metadata)

    def _health(self, timeout: Optional[float], attempts: List[Optional[float]],
                metadata: Metadata) -> str:
        check = self._healths[self._connection(None)]
        sent = self._call_metadata(metadata)
        error = None
        for delay in attempts:
            if delay is not None:
                time.sleep(delay)
            try:
                raw = check(b"", timeout=timeout if timeout is not None else self._timeout,
                            metadata=sent, wait_for_ready=self._wait_for_ready)
                return _wire.decode_health(raw)
            except grpc.RpcError as e:
                error = from_rpc_error(e, "Health.Check")
                if not self._retryable("Health.Check", error):
                    break
        raise error

    def is_serving(self, timeout: Optional[float] = None, *, metadata: Metadata = None) -> bool:
        """Whether the server serves now: its health is SERVING. False also
        when it cannot be reached in time (UNAVAILABLE, DEADLINE_EXCEEDED);
        any other failure raises. One attempt: `timeout` bounds it."""
        try:
            return self._health(timeout, [None], metadata) == "SERVING"
        except VerifyError as e:
            if e.code in _wire.UNREACHABLE_CODES:
                return False
            raise

    def server_info(self, timeout: Optional[float] = None, *,
                    metadata: Metadata = None) -> types.ServerInfo:
        """GetServerInfo as a typed ServerInfo; also refreshes the geometry
        requests are checked against. timeout (here and in every call
        below): seconds for this call, None: the client's default.
        metadata (here and below): pairs sent with this call (the class
        says how they join the client's)."""
        info = types.server_info(self._call("GetServerInfo", "GetServerInfo",
                                            verify_pb2.GetServerInfoRequest(), timeout,
                                            metadata=metadata))
        self._geometry = _wire.Geometry(info, self._regions)
        return info

    @property
    def geometry(self) -> _wire.Geometry:
        """The server's geometry (GetServerInfo on first use)."""
        return self._geometry_for(None)

    def _geometry_for(self, metadata: Metadata) -> _wire.Geometry:
        # The GetServerInfo a call makes on first use carries that call's
        # metadata: a caller that authenticates per call has no other.
        if self._geometry is None:
            self.server_info(metadata=metadata)
        return self._geometry

    def create_sequence(self, label: str = "", timeout: Optional[float] = None, *,
                        metadata: Metadata = None) -> int:
        """A new sequence (empty); returns its id. Not retried: a retry of
        one that ran would leave a sequence nobody releases."""
        return self._call("CreateSequence", "CreateSequence",
                          verify_pb2.CreateSequenceRequest(label=label), timeout,
                          metadata=metadata).sequence_id

    @contextlib.contextmanager
    def sequence(self, label: str = "", timeout: Optional[float] = None, *,
                 metadata: Metadata = None) -> Iterator[int]:
        """A new sequence for the length of a ``with`` block, released when
        the block ends, also by an exception (so a scheduler that fails
        between create and release does not hold the sequence's pages until
        the server's idle timeout)::

            with client.sequence("req-17") as sid:
                client.append_prompt(sid, kv)
                ...

        A release that fails after the block raised is not raised over the
        block's exception; one that fails after a clean block is, except
        NOT_FOUND (released meanwhile, or expired). metadata: sent with
        both calls."""
        sid = self.create_sequence(label, timeout, metadata=metadata)
        failed = True
        try:
            yield sid
            failed = False
        finally:
            try:
                self.release_sequence(sid, timeout, metadata=metadata)
            except VerifyError as e:
                if not failed and e.code != grpc.StatusCode.NOT_FOUND:
                    raise

    def append_kv(self, sequence_id: int, start_position: int, kv: Any,
                  timeout: Optional[float] = None, *, metadata: Metadata = None) -> int:
        """One AppendKv: kv is bf16 [num_layers, T, 576]. Returns the new length."""
        request = self._geometry_for(metadata).append_request(sequence_id, start_position, kv)
        return self._call("AppendKv", "AppendKv", request, timeout, sequence_id=sequence_id,
                          metadata=metadata).length

    def append_prompt(self, sequence_id: int, kv: Any, start_position: int = 0,
                      timeout: Optional[float] = None, *, metadata: Metadata = None) -> int:
        """A whole prompt in chunks under the server's message limit; returns
        the new length (timeout and metadata: per chunk)."""
        tokens = _wire.prompt_tokens(kv)
        step = self._geometry_for(metadata).prompt_chunk_tokens()
        length = start_position
        for begin in range(0, tokens, step):
            length = self.append_kv(sequence_id, start_position + begin, kv[:, begin:begin + step],
                                    timeout, metadata=metadata)
        return length

    def verify(self, layer: int, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
               timeout: Optional[float] = None, *,
               metadata: Metadata = None) -> List[_wire.VerifyResult]:
        """One layer's Verify for one or more sequences (distinct); results
        in the order of `items`. softmax_scale 0: the server's default."""
        g = self._geometry_for(metadata)
        request = g.verify_request(layer, items, softmax_scale, next(self._request_ids))
        response = self._call("Verify", "Verify", request, timeout,
                              sequence_id=items[0].sequence_id, metadata=metadata)
        return g.verify_results(request, response, self._output)

    def commit(self, sequence_id: int, accepted: Sequence[int],
               timeout: Optional[float] = None, *,
               metadata: Metadata = None) -> _wire.CommitResult:
        """Ends the pending step; `accepted` is a root-to-node path (may be empty)."""
        r = self._call("Commit", "Commit",
                       verify_pb2.CommitRequest(sequence_id=sequence_id,
                                                accepted=_wire.check_path(accepted, "accepted")),
                       timeout, sequence_id=sequence_id, metadata=metadata)
        return _wire.CommitResult(length=r.length, accepted_count=r.accepted_count)

    def release_sequence(self, sequence_id: int, timeout: Optional[float] = None, *,
                         metadata: Metadata = None) -> int:
        """Frees the sequence's pages; returns how many."""
        return self._call("ReleaseSequence", "ReleaseSequence",
                          verify_pb2.ReleaseSequenceRequest(sequence_id=sequence_id),
                          timeout, sequence_id=sequence_id, metadata=metadata).freed_pages

    # -- shared memory ------------------------------------------------------
    def register_system_shared_memory(self, name: str, region: "shm.SharedMemoryRegion",
                                      offset: int = 0, byte_size: Optional[int] = None,
                                      timeout: Optional[float] = None, *,
                                      metadata: Metadata = None) -> None:
        """Registers [offset, offset + byte_size) of `region` (a
        SharedMemoryRegion of this process) as `name`; items placed there
        (VerifyItem.shm) then travel as references."""
        request = _wire.register_request(name, region, offset, byte_size)
        self._call("RegisterSystemSharedMemory", "RegisterSystemSharedMemory", request, timeout,
                   metadata=metadata)
        self._regions[name] = _wire.RegisteredView(region, offset)

    def register_cuda_shared_memory(self, name: str, region: "cuda_shm.CudaSharedMemoryRegion",
                                    device_id: Optional[int] = None,
                                    timeout: Optional[float] = None, *,
                                    metadata: Metadata = None) -> None:
        """Registers a CudaSharedMemoryRegion (device memory of this process)
        as `name` by its CUDA IPC handle; items placed there keep q,
        draft_kv, out and lse on the device. device_id: the server's number
        of the region's device (None: this process's index of it)."""
        request = cuda_shm_request(name, region, device_id)
        self._call("RegisterCudaSharedMemory", "RegisterCudaSharedMemory", request, timeout,
                   metadata=metadata)
        self._regions[name] = cuda_shm.CudaRegisteredView(region)

    def unregister_system_shared_memory(self, name: str = "", timeout: Optional[float] = None,
                                        *, metadata: Metadata = None) -> List[str]:
        """Removes region `name` of either kind ("" : every region); returns
        the names removed."""
        names = list(self._call("UnregisterSystemSharedMemory", "UnregisterSystemSharedMemory",
                                verify_pb2.UnregisterSystemSharedMemoryRequest(name=name),
                                timeout, metadata=metadata).unregistered)
        for n in names:
            self._regions.pop(n, None)
        return names

    def system_shared_memory_status(
            self, name: str = "", timeout: Optional[float] = None, *,
            metadata: Metadata = None) -> List[types.SystemSharedMemoryStatus]:
        """`name` ("" : every region, either kind) with its use."""
        r = self._call("SystemSharedMemoryStatus", "SystemSharedMemoryStatus",
                       verify_pb2.SystemSharedMemoryStatusRequest(name=name), timeout,
                       metadata=metadata)
        return [types.from_message(types.SystemSharedMemoryStatus, m) for m in r.regions]

    def unregister_cuda_shared_memory(self, name: str = "", timeout: Optional[float] = None,
                                      *, metadata: Metadata = None) -> List[str]:
        """Removes the CUDA region `name` ("" : every CUDA region); returns the
        names removed."""
        names = list(self._call("UnregisterCudaSharedMemory", "UnregisterCudaSharedMemory",
                                verify_pb2.UnregisterCudaSharedMemoryRequest(name=name),
                                timeout, metadata=metadata).unregistered)
        for n in names:
            self._regions.pop(n, None)
        return names

    def cuda_shared_memory_status(
            self, name: str = "", timeout: Optional[float] = None, *,
            metadata: Metadata = None) -> List[types.CudaSharedMemoryStatus]:
        """The CUDA region `name` ("" : every CUDA region) with its use."""
        r = self._call("CudaSharedMemoryStatus", "CudaSharedMemoryStatus",
                       verify_pb2.CudaSharedMemoryStatusRequest(name=name), timeout,
                       metadata=metadata)
        return [types.from_message(types.CudaSharedMemoryStatus, m) for m in r.regions]

    # -- device-driven steps (mlaverify.steps, docs/steps.md) -----------------
    def open_step(self, items: Sequence[Tuple[int, Sequence[int]]],
                  ranks: Sequence["steps.StepRank"], doorbell: str = "host",
                  softmax_scale: float = 0.0, layer_timeout_ms: int = 0,
                  max_duration_ms: int = 0, timeout: Optional[float] = None, *,
                  metadata: Metadata = None) -> "steps.DeviceStep":
        """Opens a device-driven step: items are (sequence_id, parents) pairs;
        ranks place every item's tensors (one per device of a TP server);
        doorbell "host" (slots in a system region this client registered) or
        "gpu" (words in the server's device memory). Not retried."""
        request = steps.open_step_request(items, ranks, doorbell, softmax_scale,
                                          layer_timeout_ms, max_duration_ms)
        response = self._call("OpenStep", "OpenStep", request, timeout,
                              sequence_id=items[0][0] if items else None, metadata=metadata)
        try:
            return steps.DeviceStep(self, response, doorbell, ranks, self._regions)
        except Exception:
            self.abort_step(response.step_id, metadata=metadata)  # nobody could ring it
            raise

    def abort_step(self, step_id: int, timeout: Optional[float] = None, *,
                   metadata: Metadata = None) -> types.StepStatus:
        """AbortStep: ends the step early; returns once nothing of it runs
        any more, with its final status."""
        return types.from_message(types.StepStatus, self._call(
            "AbortStep", "AbortStep", verify_pb2.AbortStepRequest(step_id=step_id), timeout,
            metadata=metadata))

    def get_step(self, step_id: int, timeout: Optional[float] = None, *,
                 metadata: Metadata = None) -> types.StepStatus:
        """GetStep: the step's state."""
        return types.from_message(types.StepStatus, self._call(
            "GetStep", "GetStep", verify_pb2.GetStepRequest(step_id=step_id), timeout,
            metadata=metadata))

    # -- the native path (mlaverify.native) ----------------------------------
    def _native_client(self) -> "native.NativeClient":
        with self._native_lock:
            if self._closed:
                raise ValueError("the client is closed")
            if self._native is None:
                self._native = native.NativeClient(self)
            return self._native

    def native_verify(self, layer: int, items: Sequence[_wire.VerifyItem],
                      softmax_scale: float = 0.0, timeout: Optional[float] = None, *,
                      metadata: Metadata = None) -> List[_wire.VerifyResult]:
        """verify() of items placed in shared memory, sent by the C++ client
        (mlaverify.native): the same checks and results, `timeout` and
        `metadata` as verify()'s. NativeUnavailableError when its library is
        not there."""
        return self._native_client().verify(layer, items, softmax_scale, timeout=timeout,
                                            metadata=metadata)

    def native_bind(self, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
                    wait_for_stream: bool = True) -> "native.BoundVerify":
        """Placed items bound for the layers of a step, sent by unary native
        calls: bind once, then `verify(layer, timeout=, metadata=)` per layer
        (mlaverify.native.BoundVerify)."""
        return self._native_client().bind(items, softmax_scale, wait_for_stream)

    def native_stream(self, *, metadata: Metadata = None) -> "native.NativeVerifyStream":
        """A VerifyStream of the C++ client for items placed in shared memory
        (mlaverify.native): verify() returns the results, one call in flight;
        `metadata` goes with the stream's opening. NativeUnavailableError
        when its library is not there."""
        return native.NativeVerifyStream(self._native_client(), metadata)

    def verify_stream(self, max_in_flight: int = 16, *,
                      metadata: Metadata = None) -> "VerifyStream":
        """A pipelined stream of Verify requests (VerifyStream) on the next
        connection; use one per scheduler. metadata: sent when the stream
        opens (gRPC has no per-message metadata)."""
        return VerifyStream(self, max_in_flight, metadata=metadata)


def cuda_shm_request(name: str, region: "cuda_shm.CudaSharedMemoryRegion",
                     device_id: Optional[int]) -> verify_pb2.RegisterCudaSharedMemoryRequest:
    """The RegisterCudaSharedMemoryRequest of `region`: its allocation's
    handle, from the allocation's start to the region's end."""
    if not isinstance(region, cuda_shm.CudaSharedMemoryRegion):
        raise TypeError(f"register_cuda_shared_memory: expected a CudaSharedMemoryRegion, got "
                        f"{type(region).__name__}")
    return verify_pb2.RegisterCudaSharedMemoryRequest(
        name=name, raw_handle=region.raw_handle,
        device_id=region.device_index if device_id is None else device_id,
        byte_size=region.base_offset + region.size)


class VerifyStream:
    """A VerifyStream of one scheduler: submit() sends a request without
    waiting and returns a Future of its results; answers are matched by
    request_id. A request answered with an in-band error fails its Future
    with VerifyError and the stream goes on; if the stream itself ends with
    an error, every pending Future fails with it. At most `max_in_flight`
    requests are unanswered at once (submit blocks beyond that), so memory
    stays bounded. Use as a context manager, or call close(). metadata: as
    VerifyClient's methods take it, sent when the stream opens."""

    def __init__(self, client: VerifyClient, max_in_flight: int = 16, *,
                 metadata: Metadata = None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._client = client
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._pending = {}  # request_id -> (request, Future)
        self._lock = threading.Lock()
        self._failure: Optional[VerifyError] = None
        self._closed = False
        self._extra_metadata = metadata
        sent = client._call_metadata(metadata)  # malformed pairs raise before the stream opens
        stub = client._stubs[client._connection(None)]
        self._call = stub.VerifyStream(self._request_iterator(), metadata=sent,
                                       wait_for_ready=client._wait_for_ready)
        self._reader = threading.Thread(target=self._read, name="mlaverify-verify-stream", daemon=True)
        self._reader.start()

    def _request_iterator(self) -> Iterator[verify_pb2.VerifyRequest]:
        while True:
            request = self._requests.get()
            if request is _END:
                return
            yield request

    def submit(self, layer: int, items: Sequence[_wire.VerifyItem],
               softmax_scale: float = 0.0) -> "Future[List[_wire.VerifyResult]]":
        """Sends one layer's Verify; returns a Future of its results at once
        (blocks while max_in_flight are unanswered)."""
        geometry = self._client._geometry_for(self._extra_metadata)
        request = geometry.verify_request(layer, items, softmax_scale,
                                          next(self._client._request_ids))
        future: Future = Future()
        self._slots.acquire()
        with self._lock:
            if self._closed or self._failure is not None:
                self._slots.release()
                raise self._failure or VerifyError(grpc.StatusCode.FAILED_PRECONDITION,
                                                   "the stream is closed", "VerifyStream")
            self._pending[request.request_id] = (request, future)
        self._requests.put(request)
        return future

    def verify(self, layer: int, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
               timeout: Optional[float] = None) -> List[_wire.VerifyResult]:
        """submit() and wait for the results."""
        return self.submit(layer, items, softmax_scale).result(timeout)

    def _read(self) -> None:
        failure: Optional[VerifyError] = None
        try:
            for response in self._call:
                with self._lock:
                    entry = self._pending.pop(response.request_id, None)
                if entry is None:
                    failure = _wire.unknown_answer(response)
                    break
                self._slots.release()
                request, future = entry
                _wire.settle_answer(future, self._client.geometry, request, response,
                                    self._client._output)
        except grpc.RpcError as e:
            failure = from_rpc_error(e, "VerifyStream")
        with self._lock:
            failure = _wire.stream_end_failure(failure, bool(self._pending))
            self._failure = failure
            pending, self._pending = self._pending, {}
        for _, future in pending.values():
            self._slots.release()
            future.set_exception(failure)

    def close(self) -> None:
        """Sends the end of the stream and waits for the answers in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(_END)
        self._reader.join()

    def cancel(self) -> None:
        """Cancels the stream; requests in flight fail with CANCELLED."""
        self._call.cancel()
        self.close()

    def __enter__(self) -> "VerifyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
