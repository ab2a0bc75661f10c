"""The connection pool (separate TCP connections, a sequence's calls on one
of them, a lost connection failing only its calls), keepalive noticing a
dead peer, and which calls are retried."""

import asyncio
import time

import grpc
import numpy as np
import pytest

from mlaverify import VerifyClient, VerifyError, VerifyItem, bf16_from_float32
from mlaverify._channels import ChannelSettings
from mlaverify.aio import AsyncVerifyClient

from conftest import start_server, stop_server
from tcp_proxy import TcpProxy


def bf16(rng, *shape):
    return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * 0.5)


@pytest.fixture
def proxy(server):
    p = TcpProxy(server)
    yield p
    p.close()


def one_step(client, sid, rng):
    g = client.geometry
    for layer in range(g.num_layers):
        client.verify(layer, [VerifyItem(sid, bf16(rng, 2, g.num_heads, 576), bf16(rng, 2, 576),
                                         [-1, 0])])
    return client.commit(sid, [0])


def test_pool_opens_separate_connections_and_keeps_a_sequence_on_one(proxy):
    rng = np.random.default_rng(0)
    with VerifyClient(proxy.target, connections=4) as client:
        assert client.connections == 4
        seqs = [client.create_sequence(f"pool-{i}") for i in range(8)]
        for sid in seqs:
            client.append_kv(sid, 0, bf16(rng, client.geometry.num_layers, 5, 576))
            one_step(client, sid, rng)
        # Four channels, four TCP connections (not one shared by all).
        assert proxy.count() == 4
        # The ids spread over the connections (sequence_id % 4); that each
        # sequence's calls stay on its own is the next test's.
        assert len({sid % 4 for sid in seqs}) >= 2
        for sid in seqs:
            client.release_sequence(sid)


def test_a_lost_connection_fails_only_its_calls_and_comes_back(proxy):
    rng = np.random.default_rng(1)
    with VerifyClient(proxy.target, connections=2, timeout=10) as client:
        g = client.geometry
        seqs = []
        while len({s % 2 for s in seqs}) < 2:
            seqs.append(client.create_sequence("lost"))
        by_conn = {s % 2: s for s in seqs}
        for sid in by_conn.values():
            client.append_kv(sid, 0, bf16(rng, g.num_layers, 4, 576))
        assert proxy.count() == 2
        # The first connection the proxy saw goes silent: the sequence on
        # it fails (its deadline passes), the one on the other connection
        # goes on meanwhile.
        proxy.freeze(0)
        outcomes = {}
        for conn, sid in by_conn.items():
            item = VerifyItem(sid, bf16(rng, 1, g.num_heads, 576), bf16(rng, 1, 576), [-1])
            try:
                client.verify(0, [item], timeout=2)
                outcomes[conn] = "ok"
            except VerifyError as e:
                assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
                outcomes[conn] = "failed"
        assert sorted(outcomes.values()) == ["failed", "ok"], outcomes
        ok = [by_conn[c] for c, o in outcomes.items() if o == "ok"][0]
        failed = [by_conn[c] for c, o in outcomes.items() if o == "failed"][0]
        assert client.commit(ok, []).length == 4
        # The connection is lost for good (reset); gRPC opens a new one and
        # the sequence's calls go through again. Its Verify never reached
        # the server, so no step is pending there.
        proxy.cut(0)
        deadline = time.time() + 20
        while True:
            try:
                assert one_step(client, failed, rng).accepted_count == 1
                break
            except VerifyError as e:
                if time.time() > deadline:
                    raise
                assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                time.sleep(0.2)
        assert proxy.count() == 3
        for sid in seqs:
            client.release_sequence(sid)


def test_keepalive_notices_a_dead_peer_on_an_idle_stream(proxy):
    """A stream whose peer went silent (frozen proxy: sockets open, nothing
    forwarded) fails UNAVAILABLE once a keepalive ping goes unanswered,
    instead of waiting for ever."""
    rng = np.random.default_rng(2)
    with VerifyClient(proxy.target, timeout=60, keepalive_time_s=1.0,
                      keepalive_timeout_s=1.0) as client:
        g = client.geometry
        sid = client.create_sequence("keepalive")
        client.append_kv(sid, 0, bf16(rng, g.num_layers, 4, 576))
        item = VerifyItem(sid, bf16(rng, 2, g.num_heads, 576), bf16(rng, 2, 576), [-1, 0])
        with client.verify_stream() as stream:
            stream.verify(0, [item], timeout=30)
            proxy.frozen.set()
            started = time.time()
            future = stream.submit(1, [item])
            with pytest.raises(VerifyError) as e:
                future.result(30)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert time.time() - started < 15


def server_has_flag(flag):
    import os
    import subprocess
    out = subprocess.run([os.environ["MLAVERIFY_SERVER"], "--help"], capture_output=True,
                         text=True, timeout=30).stdout
    return flag in out


def test_an_idle_stream_outlives_the_servers_ping_limit():
    """Client pings closer than the server allows end the connection
    (GOAWAY too_many_pings); with the server's minimum interval under the
    client's keepalive time, an idle stream stays up across many pings."""
    if not server_has_flag("--http2-min-ping-interval-ms"):
        pytest.skip("this server has no --http2-min-ping-interval-ms (its ping limit is gRPC's "
                    "default, 5 minutes without data)")
    proc, target, log = start_server(["--http2-min-ping-interval-ms", "200"])
    try:
        rng = np.random.default_rng(4)
        with VerifyClient(target, keepalive_time_s=0.5, keepalive_timeout_s=2) as client:
            g = client.geometry
            sid = client.create_sequence("idle")
            client.append_kv(sid, 0, bf16(rng, g.num_layers, 3, 576))
            item = VerifyItem(sid, bf16(rng, 1, g.num_heads, 576), bf16(rng, 1, 576), [-1])
            with client.verify_stream() as stream:
                stream.verify(0, [item], timeout=10)
                time.sleep(4)  # eight client pings, idle
                assert stream.verify(1, [item], timeout=10)[0].prefix_len == 3
            client.commit(sid, [])
            client.release_sequence(sid)
    finally:
        assert stop_server(proc) == 0, open(log).read()


def test_keepalive_settings_reach_the_channel():
    opts = dict(ChannelSettings(connections=2, keepalive_time_s=20,
                                keepalive_timeout_s=5).options(1))
    assert opts["grpc.keepalive_time_ms"] == 20000 and opts["grpc.keepalive_timeout_ms"] == 5000
    assert opts["grpc.keepalive_permit_without_calls"] == 0
    assert opts["grpc.use_local_subchannel_pool"] == 1 and opts["mlaverify.connection_index"] == 1
    assert "grpc.keepalive_time_ms" not in dict(ChannelSettings(keepalive_time_s=None).options(0))
    for bad in (dict(connections=0), dict(connections=257), dict(keepalive_time_s=0)):
        with pytest.raises(ValueError):
            ChannelSettings(**bad)


def test_wait_for_ready_queues_calls_until_the_server_listens(server):
    import socket
    import threading
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    later = f"127.0.0.1:{port}"
    with VerifyClient(later, retries=0, timeout=5) as client:
        with pytest.raises(VerifyError) as e:
            client.server_info()  # nothing listens: at once
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    proxies = []
    opener = threading.Timer(1.0, lambda: proxies.append(TcpProxy(server, port)))
    with VerifyClient(later, retries=0, timeout=20, wait_for_ready=True) as client:
        opener.start()
        try:
            started = time.time()
            assert client.server_info().num_layers == 3  # queued until the port opened
            assert time.time() - started >= 0.9
        finally:
            opener.join()
            for p in proxies:
                p.close()


class FlakyStub:
    """Answers UNAVAILABLE `failures` times, then passes calls through."""

    def __init__(self, stub, failures):
        self._stub, self.failures, self.calls = stub, failures, 0

    def __getattr__(self, method):
        real = getattr(self._stub, method)

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls <= self.failures:
                raise Unavailable()
            return real(*args, **kwargs)
        return call


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "injected"


def test_only_calls_that_change_nothing_are_retried(server):
    with VerifyClient(server, retries=2, retry_backoff_s=0.01) as client:
        flaky = client._stubs[0] = FlakyStub(client._stubs[0], failures=2)
        assert client.server_info().num_layers == 3  # two UNAVAILABLE, then the answer
        assert flaky.calls == 3
        flaky.calls, flaky.failures = 0, 1
        with pytest.raises(VerifyError) as e:
            client.create_sequence("not retried")  # may have run: never retried
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and flaky.calls == 1
        flaky.calls, flaky.failures = 0, 5
        with pytest.raises(VerifyError):
            client.system_shared_memory_status()  # retried twice, then given up
        assert flaky.calls == 3
    with VerifyClient(server, retries=0) as client:
        flaky = client._stubs[0] = FlakyStub(client._stubs[0], failures=1)
        with pytest.raises(VerifyError):
            client.server_info()
        assert flaky.calls == 1


def test_asyncio_pool(server):
    async def run():
        rng = np.random.default_rng(3)
        async with AsyncVerifyClient(server, connections=3) as client:
            g = await client.geometry()
            seqs = [await client.create_sequence() for _ in range(6)]
            for sid in seqs:
                await client.append_kv(sid, 0, bf16(rng, g.num_layers, 3, 576))
            results = await asyncio.gather(*[
                client.verify(0, [VerifyItem(sid, bf16(rng, 1, g.num_heads, 576),
                                             bf16(rng, 1, 576), [-1])]) for sid in seqs])
            assert [r[0].prefix_len for r in results] == [3] * 6
            for sid in seqs:
                await client.commit(sid, [])
                await client.release_sequence(sid)
    asyncio.run(run())
