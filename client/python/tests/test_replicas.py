"""Replica routing against two CPU servers: new sequences spread over the
replicas, a sequence's calls go to its owner, a replica that stops is
marked down (its sequences fail at once with UNAVAILABLE naming it, new
ones go elsewhere) and takes sequences again once it answers."""

import asyncio

import grpc
import numpy as np
import pytest

from mlaverify import AsyncReplicaSet, ReplicaSet, VerifyError, VerifyItem, bf16_from_float32

from conftest import start_server, stop_server


def bf16(rng, *shape):
    return bf16_from_float32(rng.standard_normal(shape).astype(np.float32) * 0.5)


@pytest.fixture
def two_servers():
    servers = [start_server(), start_server()]
    yield servers
    # The list as the test left it: a test may replace a server (a restart).
    for proc, _, _ in servers:
        if proc.poll() is None:
            stop_server(proc)


def test_sequences_spread_and_follow_their_owner(two_servers):
    rng = np.random.default_rng(0)
    targets = [t for _, t, _ in two_servers]
    with ReplicaSet(targets, retry_down_after_s=0.2, timeout=10) as replicas:
        seqs = [replicas.create_sequence(f"r{i}") for i in range(4)]
        assert sorted(s.replica for s in seqs) == [0, 0, 1, 1]
        g = replicas.replica(0).geometry
        for s in seqs:
            assert replicas.append_prompt(s, bf16(rng, g.num_layers, 10, 576)) == 10
            (r,) = replicas.verify(s.replica, 0, [VerifyItem(s.id, bf16(rng, 1, g.num_heads, 576),
                                                             bf16(rng, 1, 576), [-1])])
            assert r.prefix_len == 10
            assert replicas.commit(s, []).length == 10
        # Each replica holds its own sequences' pages and no other's.
        for i in range(2):
            info = replicas.replica(i).server_info()
            assert info.live_sequences == 2
        states = replicas.states()
        assert [s.live_sequences for s in states] == [2, 2] and all(s.up for s in states)

        # Replica 1 stops: its sequences fail UNAVAILABLE naming it, at once
        # after the first failure marked it down; new sequences go to 0.
        proc, _, _ = two_servers[1]
        stop_server(proc)
        on_1 = [s for s in seqs if s.replica == 1]
        with pytest.raises(VerifyError) as e:
            replicas.commit(on_1[0], [])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "replica 1" in e.value.details
        assert not replicas.states()[1].up
        with pytest.raises(VerifyError) as e:
            replicas.commit(on_1[1], [])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "replica 1 (" in e.value.details and "is down" in e.value.details
        assert [replicas.create_sequence("after").replica for _ in range(3)] == [0, 0, 0]
        # Errors of a live replica carry its name too.
        with pytest.raises(VerifyError) as e:
            replicas.commit(seqs[0], [])  # no pending step
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details.startswith("replica 0 (")


def test_a_restarted_replica_takes_sequences_again(two_servers):
    import time
    targets = [t for _, t, _ in two_servers]
    # gRPC waits out a reconnect backoff (1 s, growing) after a refused
    # connection; shortened here so that the test sees the restart soon.
    backoff = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 500)]
    with ReplicaSet(targets, retry_down_after_s=0.5, timeout=10, retries=0,
                    options=backoff) as replicas:
        old = [replicas.create_sequence() for _ in range(2)]
        on_1 = [s for s in old if s.replica == 1][0]
        stop_server(two_servers[1][0])
        with pytest.raises(VerifyError):
            replicas.commit(on_1, [])
        assert not replicas.states()[1].up
        assert replicas.create_sequence().replica == 0
        # The same address again, a new server process.
        two_servers[1] = start_server(listen=targets[1])
        placed = []
        deadline = time.time() + 15
        while 1 not in placed and time.time() < deadline:
            time.sleep(0.3)  # creations probe it once per retry_down_after_s
            placed.append(replicas.create_sequence().replica)
        assert replicas.states()[1].up and 1 in placed, replicas.states()[1]
        # Its old sequences went with the old process: the server says so.
        with pytest.raises(VerifyError) as e:
            replicas.commit(on_1, [])
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_no_replica_up_names_each(two_servers):
    targets = [t for _, t, _ in two_servers]
    for proc, _, _ in two_servers:
        stop_server(proc)
    with ReplicaSet(targets, timeout=5, retries=0) as replicas:
        with pytest.raises(VerifyError) as e:
            replicas.create_sequence()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "replica 0" in e.value.details and "replica 1" in e.value.details


def test_bad_targets():
    with pytest.raises(ValueError, match="no targets"):
        ReplicaSet([])
    with pytest.raises(ValueError, match="given twice"):
        ReplicaSet(["127.0.0.1:1", "127.0.0.1:1"])


def test_asyncio_replica_set(two_servers):
    async def run():
        targets = [t for _, t, _ in two_servers]
        async with AsyncReplicaSet(targets, timeout=10) as replicas:
            seqs = [await replicas.create_sequence() for _ in range(2)]
            assert sorted(s.replica for s in seqs) == [0, 1]
            for s in seqs:
                assert await replicas.release_sequence(s) >= 0
            assert [st.live_sequences for st in replicas.states()] == [0, 0]
    asyncio.run(run())
