"""Per-call metadata: every method of the synchronous, asyncio and replica
clients that makes an RPC (the stream openers and the step's own calls too)
sends the caller's pairs together with the client's bearer token, a
caller's "authorization" replacing the client's rather than sent beside it.
The server here is an in-process grpcio one that records what each call
carried and answers with just enough for the client to accept."""

import asyncio
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from mlaverify import AsyncReplicaSet, ReplicaSet, VerifyClient, VerifyItem
from mlaverify._wire import merge_metadata
from mlaverify.aio import AsyncVerifyClient
from mlaverify.shm import SharedMemoryRegion
from mlaverify.steps import StepRank
from mlaverify.v1 import verify_pb2

TOKEN = "client-token"
LAYERS, HEADS = 2, 1


class Recorder:
    """What each call carried: (RPC name, its metadata as a list of pairs,
    the seconds it had left)."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def record(self, rpc, context):
        with self.lock:
            self.calls.append((rpc, [(m.key, m.value) for m in context.invocation_metadata()],
                               context.time_remaining()))

    def tagged(self, tag):
        """The calls that carried ("x-call", tag), as (rpc, metadata) pairs."""
        with self.lock:
            return [(rpc, md) for rpc, md, _ in self.calls if ("x-call", tag) in md]


def verify_answer(request):
    results = []
    for item in request.items:
        n = len(item.parents)
        results.append(verify_pb2.VerifyResult(
            sequence_id=item.sequence_id, prefix_len=0,
            out=verify_pb2.Tensor(dtype=verify_pb2.DTYPE_BF16, shape=[n, HEADS, 512],
                                  raw=bytes(n * HEADS * 512 * 2)),
            lse=verify_pb2.Tensor(dtype=verify_pb2.DTYPE_FP32, shape=[n, HEADS],
                                  raw=bytes(n * HEADS * 4))))
    return verify_pb2.VerifyResponse(request_id=request.request_id, layer=request.layer,
                                     results=results)


ANSWERS = {
    "GetServerInfo": lambda r: verify_pb2.ServerInfo(
        num_layers=LAYERS, num_heads=HEADS, max_draft_len=4, max_batch=2,
        max_message_bytes=1 << 20, default_softmax_scale=0.1, free_pages=100),
    "CreateSequence": lambda r: verify_pb2.CreateSequenceResponse(sequence_id=7),
    "AppendKv": lambda r: verify_pb2.AppendKvResponse(
        length=r.start_position + len(r.kv.raw) // (LAYERS * 576 * 2)),
    "Verify": verify_answer,
    "Commit": lambda r: verify_pb2.CommitResponse(length=len(r.accepted),
                                                  accepted_count=len(r.accepted)),
    "ReleaseSequence": lambda r: verify_pb2.ReleaseSequenceResponse(freed_pages=1),
    "UnregisterSystemSharedMemory": lambda r: verify_pb2.UnregisterSystemSharedMemoryResponse(
        unregistered=[r.name]),
    "UnregisterCudaSharedMemory": lambda r: verify_pb2.UnregisterCudaSharedMemoryResponse(
        unregistered=[r.name]),
    # As many ranks as asked, none of them usable by the client unless it
    # asked for none: a request with a rank makes open_step abort the step.
    "OpenStep": lambda r: verify_pb2.OpenStepResponse(
        step_id=5, num_layers=LAYERS, ranks=[verify_pb2.StepRankDoorbell() for _ in r.ranks]),
    "AbortStep": lambda r: verify_pb2.StepStatus(step_id=r.step_id, state="aborted"),
    "GetStep": lambda r: verify_pb2.StepStatus(step_id=r.step_id, state="running"),
}


def handlers(recorder):
    service = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]
    methods = {}
    for m in service.methods:
        request_type = getattr(verify_pb2, m.input_type.name)
        response_type = getattr(verify_pb2, m.output_type.name)
        answer = ANSWERS.get(m.name, lambda r, t=response_type: t())

        def unary(request, context, name=m.name, answer=answer):
            recorder.record(name, context)
            return answer(request)

        def stream(requests, context, name=m.name):
            recorder.record(name, context)
            for request in requests:
                yield verify_answer(request)

        kind = grpc.stream_stream_rpc_method_handler if m.client_streaming else \
            grpc.unary_unary_rpc_method_handler
        methods[m.name] = kind(stream if m.client_streaming else unary,
                               request_deserializer=request_type.FromString,
                               response_serializer=response_type.SerializeToString)

    def health(request, context):
        recorder.record("Health.Check", context)
        return b"\x08\x01"  # status: SERVING

    return [grpc.method_handlers_generic_handler(service.full_name, methods),
            grpc.method_handlers_generic_handler(
                "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(health)})]


@pytest.fixture
def fake():
    """(target, Recorder) of an in-process server."""
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers(handlers(recorder))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", recorder
    server.stop(None).wait()


def check_sent(recorder, tag, rpcs, authorization=f"Bearer {TOKEN}"):
    """The calls tagged `tag` were exactly `rpcs` (in order), each with one
    authorization header of `authorization`."""
    calls = recorder.tagged(tag)
    assert [rpc for rpc, _ in calls] == rpcs, tag
    for rpc, md in calls:
        assert [v for k, v in md if k == "authorization"] == [authorization], (tag, rpc, md)


def tag(name):
    return [("x-call", name)]


def items(rng, n=2):
    q = rng.integers(0, 1 << 15, (n, HEADS, 576), dtype=np.uint16)
    kv = rng.integers(0, 1 << 15, (n, 576), dtype=np.uint16)
    return [VerifyItem(7, q, kv, [-1] + list(range(n - 1)))]


def test_merge_replaces_the_clients_key_and_keeps_the_rest():
    own = (("authorization", "Bearer a"),)
    assert merge_metadata(own, None) is own
    assert merge_metadata(own, []) is own
    assert merge_metadata(None, [("x-b", "1")]) == (("x-b", "1"),)
    assert merge_metadata(own, [("x-b", "1"), ("x-b", "2")]) == \
        (("authorization", "Bearer a"), ("x-b", "1"), ("x-b", "2"))
    # Header names are case-insensitive: "Authorization" replaces it too.
    assert merge_metadata(own, [("Authorization", "Bearer c")]) == (("Authorization", "Bearer c"),)
    for bad in ({"x-b": "1"}, "x-b", [("x-b",)], [("x-b", "1", "2")], [(1, "v")]):
        with pytest.raises(TypeError, match="metadata"):
            merge_metadata(own, bad)


def test_sync_client_sends_per_call_metadata_on_every_rpc(fake):
    target, rec = fake
    rng = np.random.default_rng(0)
    with VerifyClient(target, auth_token=TOKEN, timeout=30) as c:
        # The first use's GetServerInfo carries the metadata of the call that
        # needed it: a caller that authenticates per call has no other.
        c.verify(0, items(rng), metadata=tag("first-verify"))
        check_sent(rec, "first-verify", ["GetServerInfo", "Verify"])

        assert c.health(metadata=tag("health")) == "SERVING"
        assert c.is_serving(metadata=tag("is_serving"))
        c.server_info(metadata=tag("server_info"))
        assert c.create_sequence("s", metadata=tag("create_sequence")) == 7
        with c.sequence("s", metadata=tag("sequence")) as sid:
            assert sid == 7
        kv = rng.integers(0, 1 << 15, (LAYERS, 3, 576), dtype=np.uint16)
        assert c.append_kv(7, 0, kv, metadata=tag("append_kv")) == 3
        assert c.append_prompt(7, kv, metadata=tag("append_prompt")) == 3
        c.verify(1, items(rng), metadata=tag("verify"))
        c.commit(7, [0], metadata=tag("commit"))
        c.release_sequence(7, metadata=tag("release_sequence"))
        with SharedMemoryRegion(4096) as region:
            c.register_system_shared_memory("r", region, metadata=tag("register_system"))
            c.system_shared_memory_status(metadata=tag("system_status"))
            assert c.unregister_system_shared_memory("r", metadata=tag("unregister_system")) == \
                ["r"]
        assert c.unregister_cuda_shared_memory("g", metadata=tag("unregister_cuda")) == ["g"]
        c.cuda_shared_memory_status(metadata=tag("cuda_status"))
        step = c.open_step([(7, [-1])], [], metadata=tag("open_step"))
        assert step.status(metadata=tag("step.status")).state == "running"
        assert step.abort(metadata=tag("step.abort")).state == "aborted"
        c.get_step(5, metadata=tag("get_step"))
        c.abort_step(5, metadata=tag("abort_step"))
        # A step the client cannot use (its doorbell region is not one of
        # this client's) is aborted at once, with the opening call's metadata.
        with pytest.raises(ValueError, match="doorbell region"):
            c.open_step([(7, [-1])], [StepRank([], doorbell_region="none")],
                        metadata=tag("open_step_aborted"))
        with c.verify_stream(metadata=tag("verify_stream")) as stream:
            stream.verify(0, items(rng))
            stream.verify(1, items(rng))

    expected = dict(CLIENT_EXPECTED, append_kv=["AppendKv"])
    for name, rpcs in expected.items():
        check_sent(rec, name, rpcs)
    # Every call above was tagged: none went out without the caller's pairs.
    assert all(("x-call" in dict(md)) for _, md, _ in rec.calls), rec.calls


def test_register_cuda_shared_memory_sends_per_call_metadata(fake):
    torch = pytest.importorskip("torch", reason="torch is not importable")
    from mlaverify import CudaSharedMemoryRegion
    target, rec = fake
    # What the request builder sees of a CUDA region, over CPU memory.
    region = CudaSharedMemoryRegion._of(torch.zeros(4096, dtype=torch.uint8), bytes(range(64)),
                                        0, device_index=0)
    with VerifyClient(target, auth_token=TOKEN) as c:
        c.register_cuda_shared_memory("g", region, metadata=tag("register_cuda"))
    check_sent(rec, "register_cuda", ["RegisterCudaSharedMemory"])


def test_callers_authorization_replaces_the_clients(fake):
    target, rec = fake
    with VerifyClient(target, auth_token=TOKEN) as c:
        c.server_info(metadata=[("authorization", "Bearer per-call"), ("x-call", "override")])
        c.health(metadata=[("authorization", "Bearer per-call"), ("x-call", "override-health")])
        c.server_info()
    check_sent(rec, "override", ["GetServerInfo"], authorization="Bearer per-call")
    check_sent(rec, "override-health", ["Health.Check"], authorization="Bearer per-call")
    # Without metadata=: the client's token alone, as before.
    assert [v for k, v in rec.calls[-1][1] if k == "authorization"] == [f"Bearer {TOKEN}"]
    # A client without a token sends the caller's pairs alone.
    with VerifyClient(target) as c:
        c.create_sequence(metadata=tag("no-token"))
    (_, md), = rec.tagged("no-token")
    assert not [k for k, _ in md if k == "authorization"]


def test_timeout_still_applies_with_metadata(fake):
    target, rec = fake
    with VerifyClient(target, auth_token=TOKEN, timeout=30) as c:
        c.server_info(2.0, metadata=tag("short"))
        c.server_info(metadata=tag("default"))
    left = {dict(md)["x-call"]: remaining for _, md, remaining in rec.calls}
    # (The server reads its clock after the client did: a few ms of slack.)
    assert left["short"] <= 2.5 < 20 < left["default"] <= 30.5


def test_asyncio_client_sends_per_call_metadata_on_every_rpc(fake):
    target, rec = fake
    rng = np.random.default_rng(1)

    async def run():
        async with AsyncVerifyClient(target, auth_token=TOKEN, timeout=30) as c:
            await c.append_kv(7, 0, rng.integers(0, 1 << 15, (LAYERS, 2, 576), dtype=np.uint16),
                              metadata=tag("first-append"))
            assert await c.health(metadata=tag("health")) == "SERVING"
            assert await c.is_serving(metadata=tag("is_serving"))
            await c.server_info(metadata=tag("server_info"))
            await c.create_sequence("s", metadata=tag("create_sequence"))
            async with c.sequence("s", metadata=tag("sequence")):
                pass
            kv = rng.integers(0, 1 << 15, (LAYERS, 3, 576), dtype=np.uint16)
            await c.append_prompt(7, kv, metadata=tag("append_prompt"))
            await c.verify(0, items(rng), metadata=tag("verify"))
            await c.commit(7, [0], metadata=tag("commit"))
            await c.release_sequence(7, metadata=tag("release_sequence"))
            with SharedMemoryRegion(4096) as region:
                await c.register_system_shared_memory("r", region, metadata=tag("register_system"))
                await c.system_shared_memory_status(metadata=tag("system_status"))
                await c.unregister_system_shared_memory("r", metadata=tag("unregister_system"))
            await c.unregister_cuda_shared_memory("g", metadata=tag("unregister_cuda"))
            await c.cuda_shared_memory_status(metadata=tag("cuda_status"))
            step = await c.open_step([(7, [-1])], [], metadata=tag("open_step"))
            await step.status(metadata=tag("step.status"))
            await step.abort(metadata=tag("step.abort"))
            await c.get_step(5, metadata=tag("get_step"))
            await c.abort_step(5, metadata=tag("abort_step"))
            with pytest.raises(ValueError, match="doorbell region"):
                await c.open_step([(7, [-1])], [StepRank([], doorbell_region="none")],
                                  metadata=tag("open_step_aborted"))
            async with await c.verify_stream(metadata=tag("verify_stream")) as stream:
                await stream.verify(0, items(rng))

    asyncio.run(run())
    expected = dict(CLIENT_EXPECTED, **{"first-append": ["GetServerInfo", "AppendKv"]})
    for name, rpcs in expected.items():
        check_sent(rec, name, rpcs)
    assert all(("x-call" in dict(md)) for _, md, _ in rec.calls), rec.calls


# The RPCs each call of the sync and asyncio clients sends, by the tag its
# x-call metadata carries.
CLIENT_EXPECTED = {
    "health": ["Health.Check"], "is_serving": ["Health.Check"],
    "server_info": ["GetServerInfo"], "create_sequence": ["CreateSequence"],
    "sequence": ["CreateSequence", "ReleaseSequence"], "append_prompt": ["AppendKv"],
    "verify": ["Verify"], "commit": ["Commit"], "release_sequence": ["ReleaseSequence"],
    "register_system": ["RegisterSystemSharedMemory"],
    "system_status": ["SystemSharedMemoryStatus"],
    "unregister_system": ["UnregisterSystemSharedMemory"],
    "unregister_cuda": ["UnregisterCudaSharedMemory"],
    "cuda_status": ["CudaSharedMemoryStatus"], "open_step": ["OpenStep"],
    "step.status": ["GetStep"], "step.abort": ["AbortStep"], "get_step": ["GetStep"],
    "abort_step": ["AbortStep"], "open_step_aborted": ["OpenStep", "AbortStep"],
    "verify_stream": ["VerifyStream"],
}

REPLICA_EXPECTED = {
    # The probe of every replica, then the creation.
    "create_sequence": ["GetServerInfo", "CreateSequence"],
    "append_kv": ["AppendKv"], "append_prompt": ["AppendKv"], "verify": ["Verify"],
    "commit": ["Commit"], "release_sequence": ["ReleaseSequence"],
}


def test_replica_sets_send_per_call_metadata(fake):
    target, rec = fake
    rng = np.random.default_rng(2)
    kv = rng.integers(0, 1 << 15, (LAYERS, 2, 576), dtype=np.uint16)
    with ReplicaSet([target], auth_token=TOKEN) as replicas:
        seq = replicas.create_sequence("s", metadata=tag("create_sequence"))
        replicas.append_kv(seq, 0, kv, metadata=tag("append_kv"))
        replicas.append_prompt(seq, kv, metadata=tag("append_prompt"))
        replicas.verify(seq.replica, 0, items(rng), metadata=tag("verify"))
        replicas.commit(seq, [0], metadata=tag("commit"))
        replicas.release_sequence(seq, metadata=tag("release_sequence"))
    for name, rpcs in REPLICA_EXPECTED.items():
        check_sent(rec, name, rpcs)

    async def run():
        async with AsyncReplicaSet([target], auth_token=TOKEN) as replicas:
            seq = await replicas.create_sequence("s", metadata=tag("a-create_sequence"))
            await replicas.append_kv(seq, 0, kv, metadata=tag("a-append_kv"))
            await replicas.append_prompt(seq, kv, metadata=tag("a-append_prompt"))
            await replicas.verify(seq.replica, 0, items(rng), metadata=tag("a-verify"))
            await replicas.commit(seq, [0], metadata=tag("a-commit"))
            await replicas.release_sequence(seq, metadata=tag("a-release_sequence"))

    asyncio.run(run())
    for name, rpcs in REPLICA_EXPECTED.items():
        check_sent(rec, f"a-{name}", rpcs)
