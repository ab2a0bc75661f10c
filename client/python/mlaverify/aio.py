"""The asyncio client, for schedulers that run an event loop: the same
methods as VerifyClient as coroutines, and an AsyncVerifyStream."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from mlaverify import _wire, cuda_shm, steps, tensors, types
from mlaverify._channels import DEFAULT_MAX_MESSAGE_BYTES, ChannelSettings, ConnectionPool
from mlaverify._wire import Metadata
from mlaverify.client import cuda_shm_request
from mlaverify.errors import VerifyError, from_rpc_error
from mlaverify.v1 import verify_pb2


class AsyncVerifyClient(_wire.ClientBase):
    """As VerifyClient (the same arguments and methods, metadata= included),
    every RPC a coroutine, on grpc.aio channels of the running event loop."""

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
            grpc.aio.secure_channel(target, credentials, opts) if credentials
            else grpc.aio.insecure_channel(target, opts)))
        super().__init__(target, pool, auth_token, timeout,
                         tensors.Output.of(as_torch, device, as_float32), retries, retry_backoff_s)

    async def close(self) -> None:
        """Closes every connection (calls in flight are cancelled)."""
        for channel in self._pool.channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncVerifyClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, rpc: str, method: str, request, timeout=None, sequence_id=None,
                    metadata: Metadata = None):
        stub = self._stubs[self._connection(sequence_id)]
        sent = self._call_metadata(metadata)
        error = None
        for delay in self._attempts(rpc):
            if delay is not None:
                await asyncio.sleep(delay)
            try:
                return await getattr(stub, method)(
                    request, timeout=timeout if timeout is not None else self._timeout,
                    metadata=sent, wait_for_ready=self._wait_for_ready)
            except grpc.RpcError as e:
                error = from_rpc_error(e, rpc)
                if not self._retryable(rpc, error):
                    break
        raise error

    async def health(self, timeout: Optional[float] = None, *, metadata: Metadata = None) -> str:
        """As VerifyClient.health."""
        return await self._health(timeout, self._attempts("Health.Check"), metadata)

    async def _health(self, timeout: Optional[float], attempts: List[Optional[float]],
                      metadata: Metadata) -> str:
        check = self._healths[self._connection(None)]
        sent = self._call_metadata(metadata)
        error = None
        for delay in attempts:
            if delay is not None:
                await asyncio.sleep(delay)
            try:
                raw = await check(b"", timeout=timeout if timeout is not None else self._timeout,
                                  metadata=sent, wait_for_ready=self._wait_for_ready)
                return _wire.decode_health(raw)
            except grpc.RpcError as e:
                error = from_rpc_error(e, "Health.Check")
                if not self._retryable("Health.Check", error):
                    break
        raise error

    async def is_serving(self, timeout: Optional[float] = None, *,
                         metadata: Metadata = None) -> bool:
        """As VerifyClient.is_serving."""
        try:
            return await self._health(timeout, [None], metadata) == "SERVING"
        except VerifyError as e:
            if e.code in _wire.UNREACHABLE_CODES:
                return False
            raise

    async def server_info(self, timeout: Optional[float] = None, *,
                          metadata: Metadata = None) -> types.ServerInfo:
        """As VerifyClient.server_info."""
        info = types.server_info(await self._call("GetServerInfo", "GetServerInfo",
                                                  verify_pb2.GetServerInfoRequest(), timeout,
                                                  metadata=metadata))
        self._geometry = _wire.Geometry(info, self._regions)
        return info

    async def geometry(self) -> _wire.Geometry:
        """The server's geometry (GetServerInfo on first use)."""
        return await self._geometry_for(None)

    async def _geometry_for(self, metadata: Metadata) -> _wire.Geometry:
        # As VerifyClient._geometry_for: the first use's call lends its metadata.
        if self._geometry is None:
            await self.server_info(metadata=metadata)
        return self._geometry

    async def create_sequence(self, label: str = "", timeout: Optional[float] = None, *,
                              metadata: Metadata = None) -> int:
        """As VerifyClient.create_sequence."""
        r = await self._call("CreateSequence", "CreateSequence",
                             verify_pb2.CreateSequenceRequest(label=label), timeout,
                             metadata=metadata)
        return r.sequence_id

    @contextlib.asynccontextmanager
    async def sequence(self, label: str = "", timeout: Optional[float] = None, *,
                       metadata: Metadata = None) -> AsyncIterator[int]:
        """As VerifyClient.sequence: ``async with client.sequence() as sid``
        releases the sequence when the block ends, by an exception too."""
        sid = await self.create_sequence(label, timeout, metadata=metadata)
        failed = True
        try:
            yield sid
            failed = False
        finally:
            try:
                await self.release_sequence(sid, timeout, metadata=metadata)
            except VerifyError as e:
                if not failed and e.code != grpc.StatusCode.NOT_FOUND:
                    raise

    async def append_kv(self, sequence_id: int, start_position: int, kv: Any,
                        timeout: Optional[float] = None, *, metadata: Metadata = None) -> int:
        """As VerifyClient.append_kv."""
        request = (await self._geometry_for(metadata)).append_request(sequence_id,
                                                                      start_position, kv)
        return (await self._call("AppendKv", "AppendKv", request, timeout,
                                 sequence_id=sequence_id, metadata=metadata)).length

    async def append_prompt(self, sequence_id: int, kv: Any, start_position: int = 0,
                            timeout: Optional[float] = None, *,
                            metadata: Metadata = None) -> int:
        """As VerifyClient.append_prompt."""
        tokens = _wire.prompt_tokens(kv)
        step = (await self._geometry_for(metadata)).prompt_chunk_tokens()
        length = start_position
        for begin in range(0, tokens, step):
            length = await self.append_kv(sequence_id, start_position + begin,
                                          kv[:, begin:begin + step], timeout, metadata=metadata)
        return length

    async def verify(self, layer: int, items: Sequence[_wire.VerifyItem],
                     softmax_scale: float = 0.0, timeout: Optional[float] = None, *,
                     metadata: Metadata = None) -> List[_wire.VerifyResult]:
        """As VerifyClient.verify."""
        g = await self._geometry_for(metadata)
        request = g.verify_request(layer, items, softmax_scale, next(self._request_ids))
        response = await self._call("Verify", "Verify", request, timeout,
                                    sequence_id=items[0].sequence_id, metadata=metadata)
        return g.verify_results(request, response, self._output)

    async def commit(self, sequence_id: int, accepted: Sequence[int],
                     timeout: Optional[float] = None, *,
                     metadata: Metadata = None) -> _wire.CommitResult:
        """As VerifyClient.commit."""
        request = verify_pb2.CommitRequest(sequence_id=sequence_id,
                                           accepted=_wire.check_path(accepted, "accepted"))
        r = await self._call("Commit", "Commit", request, timeout, sequence_id=sequence_id,
                             metadata=metadata)
        return _wire.CommitResult(length=r.length, accepted_count=r.accepted_count)

    async def release_sequence(self, sequence_id: int, timeout: Optional[float] = None, *,
                               metadata: Metadata = None) -> int:
        """As VerifyClient.release_sequence."""
        r = await self._call("ReleaseSequence", "ReleaseSequence",
                             verify_pb2.ReleaseSequenceRequest(sequence_id=sequence_id),
                             timeout, sequence_id=sequence_id, metadata=metadata)
        return r.freed_pages

    async def register_system_shared_memory(self, name: str, region, offset: int = 0,
                                            byte_size: Optional[int] = None,
                                            timeout: Optional[float] = None, *,
                                            metadata: Metadata = None) -> None:
        """As VerifyClient.register_system_shared_memory."""
        request = _wire.register_request(name, region, offset, byte_size)
        await self._call("RegisterSystemSharedMemory", "RegisterSystemSharedMemory", request,
                         timeout, metadata=metadata)
        self._regions[name] = _wire.RegisteredView(region, offset)

    async def register_cuda_shared_memory(self, name: str, region,
                                          device_id: Optional[int] = None,
                                          timeout: Optional[float] = None, *,
                                          metadata: Metadata = None) -> None:
        """As VerifyClient.register_cuda_shared_memory."""
        request = cuda_shm_request(name, region, device_id)
        await self._call("RegisterCudaSharedMemory", "RegisterCudaSharedMemory", request, timeout,
                         metadata=metadata)
        self._regions[name] = cuda_shm.CudaRegisteredView(region)

    async def unregister_system_shared_memory(self, name: str = "",
                                              timeout: Optional[float] = None, *,
                                              metadata: Metadata = None) -> List[str]:
        """As VerifyClient.unregister_system_shared_memory."""
        r = await self._call("UnregisterSystemSharedMemory", "UnregisterSystemSharedMemory",
                             verify_pb2.UnregisterSystemSharedMemoryRequest(name=name), timeout,
                             metadata=metadata)
        for n in r.unregistered:
            self._regions.pop(n, None)
        return list(r.unregistered)

    async def system_shared_memory_status(
            self, name: str = "", timeout: Optional[float] = None, *,
            metadata: Metadata = None) -> List[types.SystemSharedMemoryStatus]:
        """As VerifyClient.system_shared_memory_status."""
        r = await self._call("SystemSharedMemoryStatus", "SystemSharedMemoryStatus",
                             verify_pb2.SystemSharedMemoryStatusRequest(name=name), timeout,
                             metadata=metadata)
        return [types.from_message(types.SystemSharedMemoryStatus, m) for m in r.regions]

    async def unregister_cuda_shared_memory(self, name: str = "",
                                            timeout: Optional[float] = None, *,
                                            metadata: Metadata = None) -> List[str]:
        """As VerifyClient.unregister_cuda_shared_memory."""
        r = await self._call("UnregisterCudaSharedMemory", "UnregisterCudaSharedMemory",
                             verify_pb2.UnregisterCudaSharedMemoryRequest(name=name), timeout,
                             metadata=metadata)
        for n in r.unregistered:
            self._regions.pop(n, None)
        return list(r.unregistered)

    async def cuda_shared_memory_status(
            self, name: str = "", timeout: Optional[float] = None, *,
            metadata: Metadata = None) -> List[types.CudaSharedMemoryStatus]:
        """As VerifyClient.cuda_shared_memory_status."""
        r = await self._call("CudaSharedMemoryStatus", "CudaSharedMemoryStatus",
                             verify_pb2.CudaSharedMemoryStatusRequest(name=name), timeout,
                             metadata=metadata)
        return [types.from_message(types.CudaSharedMemoryStatus, m) for m in r.regions]

    async def open_step(self, items: Sequence[Tuple[int, Sequence[int]]],
                        ranks: Sequence["steps.StepRank"], doorbell: str = "host",
                        softmax_scale: float = 0.0, layer_timeout_ms: int = 0,
                        max_duration_ms: int = 0, timeout: Optional[float] = None, *,
                        metadata: Metadata = None) -> "steps.DeviceStep":
        """As VerifyClient.open_step. The step's ring and wait never call the
        server (they are synchronous); its abort() and status() return
        coroutines of this client's."""
        request = steps.open_step_request(items, ranks, doorbell, softmax_scale,
                                          layer_timeout_ms, max_duration_ms)
        response = await self._call("OpenStep", "OpenStep", request, timeout,
                                    sequence_id=items[0][0] if items else None,
                                    metadata=metadata)
        try:
            return steps.DeviceStep(self, response, doorbell, ranks, self._regions)
        except Exception:
            await self.abort_step(response.step_id, metadata=metadata)
            raise

    async def abort_step(self, step_id: int, timeout: Optional[float] = None, *,
                         metadata: Metadata = None) -> types.StepStatus:
        """As VerifyClient.abort_step."""
        return types.from_message(types.StepStatus, await self._call(
            "AbortStep", "AbortStep", verify_pb2.AbortStepRequest(step_id=step_id), timeout,
            metadata=metadata))

    async def get_step(self, step_id: int, timeout: Optional[float] = None, *,
                       metadata: Metadata = None) -> types.StepStatus:
        """As VerifyClient.get_step."""
        return types.from_message(types.StepStatus, await self._call(
            "GetStep", "GetStep", verify_pb2.GetStepRequest(step_id=step_id), timeout,
            metadata=metadata))

    async def verify_stream(self, max_in_flight: int = 16, *,
                            metadata: Metadata = None) -> "AsyncVerifyStream":
        """As VerifyClient.verify_stream."""
        return AsyncVerifyStream(self, await self._geometry_for(metadata), max_in_flight,
                                 metadata=metadata)


class AsyncVerifyStream:
    """As VerifyStream: `await submit(...)` sends a request (waiting while
    `max_in_flight` are unanswered) and returns an asyncio Future of its
    results; answers are matched by request_id; in-band errors fail their
    Future with VerifyError. `async with` closes it. metadata: sent when the
    stream opens."""

    def __init__(self, client: AsyncVerifyClient, geometry: _wire.Geometry, max_in_flight: int,
                 *, metadata: Metadata = None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._client = client
        self._geometry = geometry
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending = {}
        self._failure: Optional[VerifyError] = None
        self._closed = False
        stub = client._stubs[client._connection(None)]
        self._call = stub.VerifyStream(metadata=client._call_metadata(metadata),
                                       wait_for_ready=client._wait_for_ready)
        self._reader = asyncio.ensure_future(self._read())

    async def submit(self, layer: int, items: Sequence[_wire.VerifyItem],
                     softmax_scale: float = 0.0) -> "asyncio.Future[List[_wire.VerifyResult]]":
        """As VerifyStream.submit: sends one layer's Verify (waiting while
        max_in_flight are unanswered); returns an asyncio Future."""
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
        """submit() and await the results."""
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
                _wire.settle_answer(future, self._geometry, request, response,
                                    self._client._output)
        except grpc.RpcError as e:
            failure = from_rpc_error(e, "VerifyStream")
        failure = _wire.stream_end_failure(failure, bool(self._pending))
        self._failure = failure
        pending, self._pending = self._pending, {}
        for _, future in pending.values():
            self._slots.release()
            future.set_exception(failure)

    async def close(self) -> None:
        """Ends the stream and waits for the answers in flight."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._call.done_writing()
        except grpc.RpcError:
            pass  # the reader reports how the stream ended
        await self._reader

    async def cancel(self) -> None:
        """Cancels the stream; requests in flight fail with CANCELLED."""
        self._call.cancel()
        await self.close()

    async def __aenter__(self) -> "AsyncVerifyStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
