"""The asyncio client, for schedulers that run an event loop: the same
methods as VerifyClient as coroutines, and an AsyncVerifyStream."""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional, Sequence

import grpc
import grpc.aio

from mlaverify import _wire
from mlaverify.client import channel_options
from mlaverify.errors import VerifyError, from_rpc_error
from mlaverify.v1 import verify_pb2


class AsyncVerifyClient(_wire.ClientBase):
    """As VerifyClient (same arguments), every RPC a coroutine."""

    def __init__(self, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                 auth_token: Optional[str] = None, timeout: Optional[float] = 30.0,
                 as_torch: bool = False, options=None):
        opts = options if options is not None else channel_options()
        channel = (grpc.aio.secure_channel(target, credentials, opts) if credentials
                   else grpc.aio.insecure_channel(target, opts))
        super().__init__(channel, target, auth_token, timeout, as_torch)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncVerifyClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, rpc: str, method, request, timeout=None):
        try:
            return await method(request, timeout=timeout if timeout is not None else self._timeout,
                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    async def health(self, timeout: Optional[float] = None) -> str:
        try:
            raw = await self._health(b"", timeout=timeout if timeout is not None else self._timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health.Check") from None
        return _wire.decode_health(raw)

    async def server_info(self) -> verify_pb2.ServerInfo:
        info = await self._call("GetServerInfo", self._stub.GetServerInfo,
                                verify_pb2.GetServerInfoRequest())
        self._geometry = _wire.Geometry(info, self._regions)
        return info

    async def geometry(self) -> _wire.Geometry:
        if self._geometry is None:
            await self.server_info()
        return self._geometry

    async def create_sequence(self, label: str = "") -> int:
        r = await self._call("CreateSequence", self._stub.CreateSequence,
                             verify_pb2.CreateSequenceRequest(label=label))
        return r.sequence_id

    async def append_kv(self, sequence_id: int, start_position: int, kv: Any) -> int:
        request = (await self.geometry()).append_request(sequence_id, start_position, kv)
        return (await self._call("AppendKv", self._stub.AppendKv, request)).length

    async def append_prompt(self, sequence_id: int, kv: Any, start_position: int = 0) -> int:
        tokens = _wire.prompt_tokens(kv)
        step = (await self.geometry()).prompt_chunk_tokens()
        length = start_position
        for begin in range(0, tokens, step):
            length = await self.append_kv(sequence_id, start_position + begin,
                                          kv[:, begin:begin + step])
        return length

    async def verify(self, layer: int, items: Sequence[_wire.VerifyItem], softmax_scale: float = 0.0,
                     timeout: Optional[float] = None) -> List[_wire.VerifyResult]:
        g = await self.geometry()
        request = g.verify_request(layer, items, softmax_scale, next(self._request_ids))
        response = await self._call("Verify", self._stub.Verify, request, timeout)
        return g.verify_results(request, response, self._as_torch)

    async def commit(self, sequence_id: int, accepted: Sequence[int]) -> _wire.CommitResult:
        r = await self._call("Commit", self._stub.Commit,
                             verify_pb2.CommitRequest(sequence_id=sequence_id,
                                                      accepted=_wire.check_path(accepted, "accepted")))
        return _wire.CommitResult(length=r.length, accepted_count=r.accepted_count)

    async def release_sequence(self, sequence_id: int) -> int:
        r = await self._call("ReleaseSequence", self._stub.ReleaseSequence,
                             verify_pb2.ReleaseSequenceRequest(sequence_id=sequence_id))
        return r.freed_pages

    async def register_system_shared_memory(self, name: str, region, offset: int = 0,
                                            byte_size: Optional[int] = None) -> None:
        """As VerifyClient.register_system_shared_memory."""
        request = _wire.register_request(name, region, offset, byte_size)
        await self._call("RegisterSystemSharedMemory", self._stub.RegisterSystemSharedMemory,
                         request)
        self._regions[name] = _wire.RegisteredView(region, offset)

    async def unregister_system_shared_memory(self, name: str = "") -> List[str]:
        r = await self._call("UnregisterSystemSharedMemory", self._stub.UnregisterSystemSharedMemory,
                             verify_pb2.UnregisterSystemSharedMemoryRequest(name=name))
        for n in r.unregistered:
            self._regions.pop(n, None)
        return list(r.unregistered)

    async def system_shared_memory_status(
            self, name: str = "") -> List[verify_pb2.SystemSharedMemoryRegion]:
        """As VerifyClient.system_shared_memory_status."""
        r = await self._call("SystemSharedMemoryStatus", self._stub.SystemSharedMemoryStatus,
                             verify_pb2.SystemSharedMemoryStatusRequest(name=name))
        return list(r.regions)

    async def unregister_cuda_shared_memory(self, name: str = "") -> List[str]:
        """As VerifyClient.unregister_cuda_shared_memory."""
        r = await self._call("UnregisterCudaSharedMemory", self._stub.UnregisterCudaSharedMemory,
                             verify_pb2.UnregisterCudaSharedMemoryRequest(name=name))
        return list(r.unregistered)

    async def cuda_shared_memory_status(self, name: str = "") -> List[verify_pb2.CudaSharedMemoryRegion]:
        """As VerifyClient.cuda_shared_memory_status."""
        r = await self._call("CudaSharedMemoryStatus", self._stub.CudaSharedMemoryStatus,
                             verify_pb2.CudaSharedMemoryStatusRequest(name=name))
        return list(r.regions)

    async def verify_stream(self, max_in_flight: int = 16) -> "AsyncVerifyStream":
        return AsyncVerifyStream(self, await self.geometry(), max_in_flight)


class AsyncVerifyStream:
    """As VerifyStream: `await submit(...)` sends a request (waiting while
    `max_in_flight` are unanswered) and returns an asyncio Future of its
    results; answers are matched by request_id; in-band errors fail their
    Future with VerifyError. `async with` closes it."""

    def __init__(self, client: AsyncVerifyClient, geometry: _wire.Geometry, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._client = client
        self._geometry = geometry
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending = {}
        self._failure: Optional[VerifyError] = None
        self._closed = False
        self._call = client._stub.VerifyStream(metadata=client._metadata)
        self._reader = asyncio.ensure_future(self._read())

    async def submit(self, layer: int, items: Sequence[_wire.VerifyItem],
                     softmax_scale: float = 0.0) -> "asyncio.Future[List[_wire.VerifyResult]]":
        request = self._geometry.verify_request(layer, items, softmax_scale,
                                                next(self._client._request_ids))
        await self._slots.acquire()
        if self._closed or self._failure is not None:
            self._slots.release()
            raise self._failure or VerifyError(grpc.StatusCode.FAILED_PRECONDITION,
                                               "the stream is closed", "VerifyStream")
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = (request, future)
        try:
            await self._call.write(request)
        except grpc.RpcError as e:
            self._pending.pop(request.request_id, None)
            self._slots.release()
            raise from_rpc_error(e, "VerifyStream") from None
        return future

    async def verify(self, layer: int, items: Sequence[_wire.VerifyItem],
                     softmax_scale: float = 0.0) -> List[_wire.VerifyResult]:
        return await (await self.submit(layer, items, softmax_scale))

    async def _read(self) -> None:
        failure: Optional[VerifyError] = None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                entry = self._pending.pop(response.request_id, None)
                if entry is None:
                    failure = _wire.unknown_answer(response)
                    break
                self._slots.release()
                request, future = entry
                _wire.settle_answer(future, self._geometry, request, response, self._client._as_torch)
        except grpc.RpcError as e:
            failure = from_rpc_error(e, "VerifyStream")
        failure = _wire.stream_end_failure(failure, bool(self._pending))
        self._failure = failure
        pending, self._pending = self._pending, {}
        for _, future in pending.values():
            self._slots.release()
            future.set_exception(failure)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call.done_writing()
        except grpc.RpcError:
            pass  # the reader reports how the stream ended
        await self._reader

    async def __aenter__(self) -> "AsyncVerifyStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
