"""Every RPC against a live CPU server, answers checked against the NumPy
reference, the bad-input codes, a stream with an in-band error, auth, and
the asyncio client."""

import asyncio
import os
import tempfile

import grpc
import numpy as np
import pytest

from mlaverify import VerifyClient, VerifyError, VerifyItem, bf16_from_float32, tensors
from mlaverify.aio import AsyncVerifyClient
from mlaverify.reference import relative_error, verify_reference
from mlaverify.v1 import verify_pb2

from conftest import start_server, stop_server

MAX_REL_ERR = 1e-2
MAX_LSE_ERR = 1e-2


def random_bf16(rng, *shape, scale=0.5):
    return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * scale)


def random_tree(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def root_path(parents, node):
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


class Mirror:
    """The client's copy of one sequence's committed KV, per layer."""

    def __init__(self, layers):
        self.layers = [np.zeros((0, 576), dtype=np.uint16) for _ in range(layers)]

    def append_prompt(self, kv):
        self.layers = [np.concatenate([m, kv[i]]) for i, m in enumerate(self.layers)]

    def commit(self, drafts_per_layer, accepted):
        self.layers = [np.concatenate([m, drafts_per_layer[i][accepted]])
                       for i, m in enumerate(self.layers)]


def check(result, mirror, layer, item, scale):
    want_out, want_lse = verify_reference(mirror.layers[layer], item.q, item.draft_kv,
                                          item.parents, scale)
    got_out = tensors.float32_from_bf16(np.asarray(result.out))
    assert np.isfinite(got_out).all() and np.isfinite(result.lse).all()
    assert result.prefix_len == mirror.layers[layer].shape[0]
    assert relative_error(got_out, want_out) <= MAX_REL_ERR
    assert np.abs(np.asarray(result.lse) - want_lse).max() <= MAX_LSE_ERR


def test_health_and_server_info(client):
    assert client.health() == "SERVING"
    info = client.server_info()
    assert (info.num_layers, info.num_heads, info.latent_dim, info.page_size) == (3, 4, 576, 16)
    assert info.max_draft_len == 8 and info.max_batch == 4 and info.backend == "cpu"
    assert len(info.instance_id) > 0


def test_decode_steps_match_the_reference(client):
    rng = np.random.default_rng(1)
    g = client.geometry
    scale = g.default_softmax_scale
    seqs = [client.create_sequence(f"pytest-{i}") for i in range(2)]
    mirrors = [Mirror(g.num_layers) for _ in seqs]
    for k, (sid, mirror) in enumerate(zip(seqs, mirrors)):
        prompt = random_bf16(rng, g.num_layers, 40 + 17 * k, 576)
        assert client.append_prompt(sid, prompt) == prompt.shape[1]
        mirror.append_prompt(prompt)
    for step in range(3):
        n = [5, 8, 3][step]
        trees = [random_tree(rng, n) for _ in seqs]
        drafts = [[random_bf16(rng, n, 576) for _ in range(g.num_layers)] for _ in seqs]
        for layer in range(g.num_layers):
            items = [VerifyItem(sid, random_bf16(rng, n, g.num_heads, 576), drafts[s][layer], trees[s])
                     for s, sid in enumerate(seqs)]
            for item, result in zip(items, client.verify(layer, items)):
                assert result.sequence_id == item.sequence_id
                check(result, mirrors[seqs.index(item.sequence_id)], layer, item, scale)
        for s, sid in enumerate(seqs):
            accepted = root_path(trees[s], n - 1) if step != 1 else []
            before = mirrors[s].layers[0].shape[0]
            r = client.commit(sid, accepted)
            assert (r.length, r.accepted_count) == (before + len(accepted), len(accepted))
            mirrors[s].commit(drafts[s], accepted)
    for sid in seqs:
        assert client.release_sequence(sid) > 0
        with pytest.raises(VerifyError) as e:
            client.release_sequence(sid)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_is_serving_says_true_false_and_unreachable(client, server):
    assert client.is_serving() is True
    # Nothing listens on a port just bound and closed: not serving, no raise.
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with VerifyClient(f"127.0.0.1:{port}", retries=0) as nobody:
        assert nobody.is_serving(timeout=2.0) is False

    async def run():
        async with AsyncVerifyClient(server) as aclient:
            assert await aclient.is_serving() is True
        async with AsyncVerifyClient(f"127.0.0.1:{port}", retries=0) as anybody:
            assert await anybody.is_serving(timeout=2.0) is False

    asyncio.run(run())


def test_client_side_checks_raise_before_the_call(client):
    g = client.geometry
    sid = client.create_sequence()
    try:
        q = np.zeros((2, g.num_heads, 576), dtype=np.uint16)
        kv = np.zeros((2, 576), dtype=np.uint16)
        with pytest.raises(ValueError, match="layers 0..2"):
            client.verify(3, [VerifyItem(sid, q, kv, [-1, 0])])
        with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
            client.verify(0, [VerifyItem(sid, q, kv, [-1, 1])])
        with pytest.raises(ValueError, match="9 drafts"):
            client.verify(0, [VerifyItem(sid, q, kv, [-1] * 9)])
        with pytest.raises(ValueError, match="q: expected shape"):
            client.verify(0, [VerifyItem(sid, q[:1], kv, [-1, 0])])
        with pytest.raises(TypeError, match="uint16"):
            client.verify(0, [VerifyItem(sid, q.astype(np.float32), kv, [-1, 0])])
        with pytest.raises(ValueError, match="twice"):
            client.verify(0, [VerifyItem(sid, q, kv, [-1, 0])] * 2)
        with pytest.raises(ValueError, match="not finite"):
            client.verify(0, [VerifyItem(sid, q, kv, [-1, 0])], softmax_scale=float("nan"))
    finally:
        client.release_sequence(sid)


def code_of(call, *args):
    with pytest.raises(VerifyError) as e:
        call(*args)
    return e.value.code


def test_server_codes_and_nothing_changes(client):
    rng = np.random.default_rng(2)
    g = client.geometry
    free_before = client.server_info().free_pages
    sid = client.create_sequence()
    prompt = random_bf16(rng, g.num_layers, 20, 576)
    client.append_kv(sid, 0, prompt)
    q = random_bf16(rng, 2, g.num_heads, 576)
    kv = random_bf16(rng, 2, 576)
    C = grpc.StatusCode
    assert code_of(client.append_kv, sid, 5, prompt) == C.FAILED_PRECONDITION  # wrong start
    assert code_of(client.commit, sid, []) == C.FAILED_PRECONDITION             # no pending step
    assert code_of(client.verify, 0, [VerifyItem(sid ^ 1, q, kv, [-1, 0])]) == C.NOT_FOUND
    assert code_of(client.create_sequence, "x" * 257) == C.INVALID_ARGUMENT
    big = np.zeros((g.num_layers, 400, 576), dtype=np.uint16)  # 1.38 MB > 1 MiB
    assert code_of(client.append_kv, sid, 20, big) == C.RESOURCE_EXHAUSTED
    client.verify(0, [VerifyItem(sid, q, kv, [-1, 0])])
    assert code_of(client.verify, 1, [VerifyItem(sid, q, kv, [-1, -1])]) == C.FAILED_PRECONDITION
    assert code_of(client.commit, sid, [1]) == C.INVALID_ARGUMENT                # not from a root
    assert code_of(client.append_kv, sid, 20, prompt) == C.FAILED_PRECONDITION  # step pending
    # A tensor the client would not build, straight through the stub.
    bad = verify_pb2.VerifyRequest(layer=0, items=[verify_pb2.VerifyItem(
        sequence_id=sid, parents=[-1, 0], draft_kv=tensors.to_proto(kv, "bf16", [2, 576], "kv"),
        q=verify_pb2.Tensor(dtype=verify_pb2.DTYPE_BF16, shape=[2, g.num_heads, 576], raw=b"12"))])
    with pytest.raises(grpc.RpcError) as e:
        client._stub.Verify(bad, timeout=10)
    assert e.value.code() == C.INVALID_ARGUMENT
    assert client.commit(sid, []).length == 20
    assert client.release_sequence(sid) > 0
    assert client.server_info().free_pages == free_before


def test_stream_answers_in_order_with_an_in_band_error(client):
    rng = np.random.default_rng(3)
    g = client.geometry
    sid = client.create_sequence()
    mirror = Mirror(g.num_layers)
    prompt = random_bf16(rng, g.num_layers, 33, 576)
    client.append_prompt(sid, prompt)
    mirror.append_prompt(prompt)
    tree = [-1, 0, 0, 1]
    items = [VerifyItem(sid, random_bf16(rng, 4, g.num_heads, 576), random_bf16(rng, 4, 576), tree)
             for _ in range(g.num_layers)]
    with client.verify_stream(max_in_flight=2) as stream:
        first = stream.submit(0, [items[0]])
        bad = stream.submit(1, [VerifyItem(sid ^ 7, items[1].q, items[1].draft_kv, tree)])
        rest = [stream.submit(layer, [items[layer]]) for layer in range(1, g.num_layers)]
        check(first.result(30)[0], mirror, 0, items[0], g.default_softmax_scale)
        with pytest.raises(VerifyError) as e:
            bad.result(30)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        for layer, future in enumerate(rest, start=1):
            check(future.result(30)[0], mirror, layer, items[layer], g.default_softmax_scale)
    assert client.commit(sid, [0, 1]).accepted_count == 2
    client.release_sequence(sid)


def test_auth_token():
    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        f.write("s3cret-token\n")
    proc, target, log = start_server(["--auth-token-file", f.name])
    try:
        with VerifyClient(target) as anonymous:
            assert anonymous.health() == "SERVING"  # health stays open
            with pytest.raises(VerifyError) as e:
                anonymous.create_sequence()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with VerifyClient(target, auth_token="s3cret-token") as authed:
            sid = authed.create_sequence()
            authed.release_sequence(sid)
    finally:
        assert stop_server(proc) == 0, open(log).read()
        os.unlink(f.name)


@pytest.mark.skipif(not tensors.torch_available(), reason="torch is not importable")
def test_torch_tensors_in_and_out(server):
    import torch
    with VerifyClient(server, as_torch=True) as client:
        g = client.geometry
        sid = client.create_sequence()
        prompt = torch.randn(g.num_layers, 24, 576).to(torch.bfloat16)
        client.append_prompt(sid, prompt)
        q = torch.randn(3, g.num_heads, 576).to(torch.bfloat16)
        kv = torch.randn(3, 576).to(torch.bfloat16)
        (r,) = client.verify(0, [VerifyItem(sid, q, kv, [-1, 0, 1])])
        assert r.out.dtype == torch.bfloat16 and tuple(r.out.shape) == (3, g.num_heads, 512)
        want, _ = verify_reference(prompt[0].float().numpy(), q.float().numpy(), kv.float().numpy(),
                                   [-1, 0, 1], g.default_softmax_scale)
        assert relative_error(r.out.float().numpy(), want) <= MAX_REL_ERR
        client.commit(sid, [])
        client.release_sequence(sid)


def test_float32_results(server):
    """as_float32=True: `out` comes back as float32 values, the bf16 the
    server computed widened exactly, unary and stream alike."""
    from mlaverify import float32_from_bf16
    rng = np.random.default_rng(11)
    with VerifyClient(server, as_float32=True) as client:
        g = client.geometry
        sid = client.create_sequence("float32")
        prompt = random_bf16(rng, g.num_layers, 24, 576)
        client.append_prompt(sid, prompt)
        q = random_bf16(rng, 3, g.num_heads, 576)
        kv = random_bf16(rng, 3, 576)
        (r,) = client.verify(0, [VerifyItem(sid, q, kv, [-1, 0, 1])])
        with client.verify_stream() as stream:
            (s,) = stream.verify(1, [VerifyItem(sid, q, kv, [-1, 0, 1])])
        for result in (r, s):
            assert result.out.dtype == np.float32 and result.out.shape == (3, g.num_heads, 512)
            assert result.lse.dtype == np.float32
            # Exactly bf16 values: widening their bits gives them back.
            assert np.array_equal(float32_from_bf16(bf16_from_float32(result.out)), result.out)
        want, _ = verify_reference(float32_from_bf16(prompt[0]), float32_from_bf16(q),
                                   float32_from_bf16(kv), [-1, 0, 1], g.default_softmax_scale)
        assert relative_error(r.out, want) <= MAX_REL_ERR
        client.commit(sid, [])
        client.release_sequence(sid)


def test_asyncio_client_and_stream(server):
    async def run():
        rng = np.random.default_rng(4)
        async with AsyncVerifyClient(server) as client:
            assert await client.health() == "SERVING"
            g = await client.geometry()
            sid = await client.create_sequence("asyncio")
            mirror = Mirror(g.num_layers)
            prompt = random_bf16(rng, g.num_layers, 50, 576)
            assert await client.append_prompt(sid, prompt) == 50
            mirror.append_prompt(prompt)
            tree = [-1, 0, 1]
            items = [VerifyItem(sid, random_bf16(rng, 3, g.num_heads, 576),
                                random_bf16(rng, 3, 576), tree) for _ in range(g.num_layers)]
            (r,) = await client.verify(0, [items[0]])
            check(r, mirror, 0, items[0], g.default_softmax_scale)
            async with await client.verify_stream(max_in_flight=2) as stream:
                futures = [await stream.submit(layer, [items[layer]]) for layer in range(g.num_layers)]
                bad = await stream.submit(0, [VerifyItem(sid ^ 9, items[0].q, items[0].draft_kv, tree)])
                for layer, f in enumerate(futures):
                    check((await f)[0], mirror, layer, items[layer], g.default_softmax_scale)
                with pytest.raises(VerifyError) as e:
                    await bad
                assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert (await client.commit(sid, [0, 1, 2])).length == 53
            assert await client.release_sequence(sid) > 0

    asyncio.run(run())


def test_shared_memory_plane_matches_the_reference(client):
    """q and draft_kv by reference, out and lse written into the region:
    unary and stream answers match the reference; the region's use is
    counted and it goes away on request."""
    from mlaverify import SharedMemoryRegion, place_item
    from mlaverify.shm import item_bytes

    rng = np.random.default_rng(7)
    info = client.server_info()
    n = 4
    with SharedMemoryRegion(2 * item_bytes(n, info.num_heads)) as region:
        client.register_system_shared_memory("py-plane", region)
        place = place_item("py-plane", 0, n, info.num_heads)
        seq = client.create_sequence("shm")
        mirror = Mirror(info.num_layers)
        prompt = random_bf16(rng, info.num_layers, 20, 576)
        client.append_prompt(seq, prompt)
        mirror.append_prompt(prompt)
        parents = random_tree(rng, n)
        drafts = [random_bf16(rng, n, 576) for _ in range(info.num_layers)]
        with client.verify_stream() as stream:
            for layer in range(info.num_layers):
                item = VerifyItem(seq, random_bf16(rng, n, info.num_heads, 576), drafts[layer],
                                  parents, shm=place)
                call = client.verify if layer % 2 == 0 else stream.verify
                (result,) = call(layer, [item])
                check(result, mirror, layer, item, info.default_softmax_scale)
        (status,) = client.system_shared_memory_status("py-plane")
        assert status.key == region.key and status.calls_total == info.num_layers
        assert status.calls_in_flight == 0
        client.commit(seq, [])
        # A reference to a region the server does not know: NOT_FOUND.
        client._regions["py-gone"] = client._regions["py-plane"]
        gone = place_item("py-gone", 0, n, info.num_heads)
        with pytest.raises(VerifyError) as e:
            client.verify(0, [VerifyItem(seq, random_bf16(rng, n, info.num_heads, 576), drafts[0],
                                         parents, shm=gone)])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        del client._regions["py-gone"]
        # The CUDA-only RPCs see no system region (and the CPU server has no CUDA ones).
        assert client.cuda_shared_memory_status() == []
        with pytest.raises(VerifyError) as e:
            client.unregister_cuda_shared_memory("py-plane")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert client.unregister_system_shared_memory("py-plane") == ["py-plane"]
        client.release_sequence(seq)


def test_asyncio_client_over_shared_memory(server):
    from mlaverify import SharedMemoryRegion, place_item
    from mlaverify.shm import item_bytes

    async def run():
        rng = np.random.default_rng(11)
        async with AsyncVerifyClient(server, timeout=30) as c:
            info = await c.server_info()
            with SharedMemoryRegion(item_bytes(2, info.num_heads)) as region:
                await c.register_system_shared_memory("py-aio", region)
                seq = await c.create_sequence("aio-shm")
                mirror = Mirror(info.num_layers)
                item = VerifyItem(seq, random_bf16(rng, 2, info.num_heads, 576),
                                  random_bf16(rng, 2, 576), [-1, 0],
                                  shm=place_item("py-aio", 0, 2, info.num_heads))
                (result,) = await c.verify(0, [item])
                check(result, mirror, 0, item, info.default_softmax_scale)
                await c.commit(seq, [])
                assert await c.unregister_system_shared_memory("py-aio") == ["py-aio"]
                await c.release_sequence(seq)

    asyncio.run(run())


def test_fp8_server_matches_the_fp8_reference():
    """A server with --kv-dtype fp8 attends to the rows as it stores them:
    its answers match verify_reference(kv_dtype="fp8") and not the bf16
    reference; rows holding NaN are refused with INVALID_ARGUMENT."""
    proc, target, log = start_server(["--kv-dtype", "fp8"])
    try:
        with VerifyClient(target, timeout=30) as c:
            info = c.server_info()
            assert (info.kv_dtype, info.kv_row_bytes) == ("fp8", 656)
            g = c.geometry
            rng = np.random.default_rng(8)
            sid = c.create_sequence("fp8")
            prompt = random_bf16(rng, g.num_layers, 50, 576, scale=1.0)
            assert c.append_prompt(sid, prompt) == 50
            n = 6
            tree = random_tree(rng, n)
            for layer in range(g.num_layers):
                item = VerifyItem(sid, random_bf16(rng, n, g.num_heads, 576, scale=2.0),
                                  random_bf16(rng, n, 576, scale=1.0), tree)
                (result,) = c.verify(layer, [item])
                got = tensors.float32_from_bf16(np.asarray(result.out))
                args = (prompt[layer], item.q, item.draft_kv, item.parents,
                        g.default_softmax_scale)
                fp8_out, fp8_lse = verify_reference(*args, kv_dtype="fp8")
                bf16_out, _ = verify_reference(*args)
                assert relative_error(got, fp8_out) <= 5e-3
                assert np.abs(np.asarray(result.lse) - fp8_lse).max() <= 1e-3
                # The two references differ by more than the check's bound, so
                # the check above would catch a server that did not quantize.
                assert relative_error(fp8_out, bf16_out) > 5e-3
            bad = random_bf16(rng, g.num_layers, 2, 576)
            bad[1, 1, 7] = 0x7fc0  # bf16 NaN
            with pytest.raises(VerifyError) as e:
                c.append_prompt(sid, bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert c.commit(sid, []).length == 50
    finally:
        assert stop_server(proc) == 0, open(log).read()


def test_sequence_context_releases_on_error_and_on_exit(client):
    g = client.geometry
    rng = np.random.default_rng(5)
    free_before = client.server_info().free_pages
    with pytest.raises(RuntimeError, match="scheduler failed"):
        with client.sequence("ctx-error") as sid:
            client.append_kv(sid, 0, random_bf16(rng, g.num_layers, 70, 576))
            assert client.server_info().free_pages < free_before
            raise RuntimeError("scheduler failed")
    assert client.server_info().free_pages == free_before
    assert code_of(client.commit, sid, []) == grpc.StatusCode.NOT_FOUND  # gone
    with client.sequence("ctx-clean") as sid:
        client.append_kv(sid, 0, random_bf16(rng, g.num_layers, 70, 576))
        client.release_sequence(sid)  # released inside: the exit's NOT_FOUND is no error
    assert client.server_info().free_pages == free_before


def test_asyncio_sequence_context_releases_on_error(server):
    async def run():
        rng = np.random.default_rng(6)
        async with AsyncVerifyClient(server) as client:
            g = await client.geometry()
            free_before = (await client.server_info()).free_pages
            with pytest.raises(RuntimeError, match="scheduler failed"):
                async with client.sequence("actx") as sid:
                    await client.append_kv(sid, 0, random_bf16(rng, g.num_layers, 70, 576))
                    raise RuntimeError("scheduler failed")
            assert (await client.server_info()).free_pages == free_before
            with pytest.raises(VerifyError) as e:
                await client.commit(sid, [])
            assert e.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())


def test_every_sequence_call_takes_a_timeout(client, monkeypatch):
    # Each call hands its `timeout` to the RPC (None: the client's default),
    # the sequence() context manager to both of its calls.
    seen = []
    real_call = client._call

    def recording_call(rpc, method, request, timeout=None, sequence_id=None, metadata=None):
        seen.append((rpc, timeout))
        return real_call(rpc, method, request, timeout, sequence_id=sequence_id,
                         metadata=metadata)

    monkeypatch.setattr(client, "_call", recording_call)
    g = client.server_info(timeout=7.5)
    kv = random_bf16(np.random.default_rng(8), g.num_layers, 4, 576)
    with client.sequence("timeouts", timeout=7.5) as sid:
        client.append_kv(sid, 0, kv, timeout=7.5)
        client.append_prompt(sid, kv, start_position=4, timeout=7.5)
        with pytest.raises(VerifyError):  # no step pending: refused, with the timeout sent
            client.commit(sid, [], timeout=7.5)
    assert {rpc for rpc, _ in seen} == {"GetServerInfo", "CreateSequence", "AppendKv", "Commit",
                                        "ReleaseSequence"}, seen
    assert all(t == 7.5 for _, t in seen), seen
    seen.clear()
    client.server_info()
    assert seen == [("GetServerInfo", None)]
    # The shared-memory and step calls alike (refusals included: the timeout
    # is sent all the same).
    from mlaverify import SharedMemoryRegion
    seen.clear()
    with SharedMemoryRegion(4096) as region:
        client.register_system_shared_memory("py-timeouts", region, timeout=7.5)
        client.system_shared_memory_status("py-timeouts", timeout=7.5)
        client.unregister_system_shared_memory("py-timeouts", timeout=7.5)
    client.cuda_shared_memory_status(timeout=7.5)
    client.unregister_cuda_shared_memory(timeout=7.5)
    for call in (client.get_step, client.abort_step):
        with pytest.raises(VerifyError):  # no such step
            call(12345, timeout=7.5)
    with pytest.raises(VerifyError):  # no such sequence
        client.open_step([(1, [-1])], [], timeout=7.5)
    assert [rpc for rpc, _ in seen] == [
        "RegisterSystemSharedMemory", "SystemSharedMemoryStatus", "UnregisterSystemSharedMemory",
        "CudaSharedMemoryStatus", "UnregisterCudaSharedMemory", "GetStep", "AbortStep",
        "OpenStep"], seen
    assert all(t == 7.5 for _, t in seen), seen
