"""The synchronous client: one typed method per RPC, and VerifyStream, a
pipelined per-scheduler stream of Verify requests."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Iterator, List, Optional, Sequence

import grpc

from mlaverify import _wire, shm
from mlaverify.errors import VerifyError, from_rpc_error
from mlaverify.v1 import verify_pb2

# Up to the largest message the server takes (its --max-message-bytes is
# 64 MiB at most in practice; GetServerInfo says what it is).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


class VerifyClient(_wire.ClientBase):
    """A client of one mlaverify server.

    target: "host:port". credentials: grpc.ssl_channel_credentials(...) for
    TLS/mTLS (None: plaintext). auth_token: the server's --auth-token-file
    contents, sent as a bearer token. timeout: seconds per call (None: no
    deadline). as_torch: Verify results as torch tensors instead of NumPy.
    """

    def __init__(self, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                 auth_token: Optional[str] = None, timeout: Optional[float] = 30.0,
                 as_torch: bool = False, options=None):
        opts = options if options is not None else channel_options()
        channel = (grpc.secure_channel(target, credentials, opts) if credentials
                   else grpc.insecure_channel(target, opts))
        super().__init__(channel, target, auth_token, timeout, as_torch)

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "VerifyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, rpc: str, method, request, timeout=None):
        try:
            return method(request, timeout=timeout if timeout is not None else self._timeout,
                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    # -- RPCs ---------------------------------------------------------------
    def health(self, timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check of the whole server: "SERVING", "NOT_SERVING"..."""
        try:
            raw = self._health(b"", timeout=timeout if timeout is not None else self._timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health.Check") from None
        return _wire.decode_health(raw)

    def server_info(self) -> verify_pb2.ServerInfo:
        """GetServerInfo; also refreshes the geometry requests are checked against."""
        info = self._call("GetServerInfo", self._stub.GetServerInfo, verify_pb2.GetServerInfoRequest())
        self._geometry = _wire.Geometry(info, self._regions)
        return info

    @property
    def geometry(self) -> _wire.Geometry:
        if self._geometry is None:
            self.server_info()
        return self._geometry

    def create_sequence(self, label: str = "") -> int:
        return self._call("CreateSequence", self._stub.CreateSequence,
                          verify_pb2.CreateSequenceRequest(label=label)).sequence_id

    def append_kv(self, sequence_id: int, start_position: int, kv: Any) -> int:
        """One AppendKv: kv is bf16 [num_layers, T, 576]. Returns the new length."""
        request = self.geometry.append_request(sequence_id, start_position, kv)
        return self._call("AppendKv", self._stub.AppendKv, request).length

    def append_prompt(self, sequence_id: int, kv: Any, start_position: int = 0) -> int:
        """A whole prompt in chunks under the server's message limit."""
        tokens = _wire.prompt_tokens(kv)
        step = self.geometry.prompt_chunk_tokens()
        length = start_position
        for begin in range(0, tokens, step):
            length = self.append_kv(sequence_id, start_position + begin, kv[:, begin:begin + step])
        return length

    def verify(self, layer: int, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
               timeout: Optional[float] = None) -> List[_wire.VerifyResult]:
        """One layer's Verify for one or more sequences (distinct)."""
        request = self.geometry.verify_request(layer, items, softmax_scale, next(self._request_ids))
        response = self._call("Verify", self._stub.Verify, request, timeout)
        return self.geometry.verify_results(request, response, self._as_torch)

    def commit(self, sequence_id: int, accepted: Sequence[int]) -> _wire.CommitResult:
        """Ends the pending step; `accepted` is a root-to-node path (may be empty)."""
        r = self._call("Commit", self._stub.Commit,
                       verify_pb2.CommitRequest(sequence_id=sequence_id,
                                                accepted=_wire.check_path(accepted, "accepted")))
        return _wire.CommitResult(length=r.length, accepted_count=r.accepted_count)

    def release_sequence(self, sequence_id: int) -> int:
        """Frees the sequence's pages; returns how many."""
        return self._call("ReleaseSequence", self._stub.ReleaseSequence,
                          verify_pb2.ReleaseSequenceRequest(sequence_id=sequence_id)).freed_pages

    # -- system shared memory ------------------------------------------------
    def register_system_shared_memory(self, name: str, region: "shm.SharedMemoryRegion",
                                      offset: int = 0, byte_size: Optional[int] = None) -> None:
        """Registers [offset, offset + byte_size) of `region` (a
        SharedMemoryRegion of this process) as `name`; items placed there
        (VerifyItem.shm) then travel as references."""
        request = _wire.register_request(name, region, offset, byte_size)
        self._call("RegisterSystemSharedMemory", self._stub.RegisterSystemSharedMemory, request)
        self._regions[name] = _wire.RegisteredView(region, offset)

    def unregister_system_shared_memory(self, name: str = "") -> List[str]:
        """Removes `name` ("" : every region); returns the names removed."""
        names = list(self._call("UnregisterSystemSharedMemory",
                                self._stub.UnregisterSystemSharedMemory,
                                verify_pb2.UnregisterSystemSharedMemoryRequest(name=name)).unregistered)
        for n in names:
            self._regions.pop(n, None)
        return names

    def system_shared_memory_status(self, name: str = "") -> List[verify_pb2.SystemSharedMemoryRegion]:
        """`name` ("" : every region, either kind) with its use."""
        return list(self._call("SystemSharedMemoryStatus", self._stub.SystemSharedMemoryStatus,
                               verify_pb2.SystemSharedMemoryStatusRequest(name=name)).regions)

    def unregister_cuda_shared_memory(self, name: str = "") -> List[str]:
        """Removes the CUDA region `name` ("" : every CUDA region); returns the
        names removed."""
        return list(self._call("UnregisterCudaSharedMemory", self._stub.UnregisterCudaSharedMemory,
                               verify_pb2.UnregisterCudaSharedMemoryRequest(name=name)).unregistered)

    def cuda_shared_memory_status(self, name: str = "") -> List[verify_pb2.CudaSharedMemoryRegion]:
        """The CUDA region `name` ("" : every CUDA region) with its use."""
        return list(self._call("CudaSharedMemoryStatus", self._stub.CudaSharedMemoryStatus,
                               verify_pb2.CudaSharedMemoryStatusRequest(name=name)).regions)

    def verify_stream(self, max_in_flight: int = 16) -> "VerifyStream":
        return VerifyStream(self, max_in_flight)


_END = object()


class VerifyStream:
    """A VerifyStream of one scheduler: submit() sends a request without
    waiting and returns a Future of its results; answers are matched by
    request_id. A request answered with an in-band error fails its Future
    with VerifyError and the stream goes on; if the stream itself ends with
    an error, every pending Future fails with it. At most `max_in_flight`
    requests are unanswered at once (submit blocks beyond that), so memory
    stays bounded. Use as a context manager, or call close()."""

    def __init__(self, client: VerifyClient, max_in_flight: int = 16):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._client = client
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._pending = {}  # request_id -> (request, Future)
        self._lock = threading.Lock()
        self._failure: Optional[VerifyError] = None
        self._closed = False
        self._call = client._stub.VerifyStream(self._request_iterator(), metadata=client._metadata)
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
        request = self._client.geometry.verify_request(layer, items, softmax_scale,
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
                                    self._client._as_torch)
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
        self._call.cancel()
        self.close()

    def __enter__(self) -> "VerifyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
