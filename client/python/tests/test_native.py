"""The native path (mlaverify.native: the C++ client's Verify through
libmlaverify_native.so) against a live CPU server over system shared memory:
the same results as the pure-Python path, the same client-side checks, the
server's in-band errors; and a clear error where the library is absent.

CTest sets MLAVERIFY_NATIVE_LIB to the library it built: then it must load.
Without it and without a library in the package (a wheel built without
MLAVERIFY_NATIVE_LIB_PATH) the tests that need it are skipped."""

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from mlaverify import SharedMemoryRegion, VerifyError, VerifyItem, native, place_item
from mlaverify.shm import item_bytes

from test_client import Mirror, check, random_bf16, random_tree, root_path

needs_native = pytest.mark.skipif(
    not os.environ.get("MLAVERIFY_NATIVE_LIB") and not native.available(),
    reason="no native library (the build writes libmlaverify_native.so; a wheel carries it only "
           "when built with MLAVERIFY_NATIVE_LIB_PATH)")


def test_the_built_library_loads():
    if os.environ.get("MLAVERIFY_NATIVE_LIB"):
        native.load()  # raises, saying why, when the build's library does not load
    else:
        pytest.skip("MLAVERIFY_NATIVE_LIB is not set (not a CTest run)")


@needs_native
def test_native_results_equal_the_pure_python_paths(client):
    """Steps over every layer, each layer verified four ways (pure-Python
    unary and stream, native unary and stream) with the same inputs: equal
    results, which match the reference."""
    rng = np.random.default_rng(11)
    info = client.server_info()
    n, heads = 4, info.num_heads
    with SharedMemoryRegion(2 * item_bytes(n, heads)) as region:
        client.register_system_shared_memory("py-native", region)
        places = [place_item("py-native", 0, n, heads),
                  place_item("py-native", item_bytes(n, heads), n, heads)]
        seq = client.create_sequence("native")
        mirror = Mirror(info.num_layers)
        prompt = random_bf16(rng, info.num_layers, 19, 576)
        client.append_prompt(seq, prompt)
        mirror.append_prompt(prompt)
        with client.verify_stream() as stream, client.native_stream() as fast:
            for step in range(3):
                parents = random_tree(rng, n)
                drafts = [random_bf16(rng, n, 576) for _ in range(info.num_layers)]
                for layer in range(info.num_layers):
                    q = random_bf16(rng, n, heads, 576)
                    results = []
                    for call in (client.verify, stream.verify, client.native_verify, fast.verify):
                        # Alternate placements: the inputs are written per call.
                        place = places[len(results) % 2]
                        item = VerifyItem(seq, q, drafts[layer], parents, shm=place)
                        (r,) = call(layer, [item])
                        results.append((np.array(r.out), np.array(r.lse), r.prefix_len, item))
                    ref_out, ref_lse, ref_len, item = results[0]
                    for out, lse, prefix_len, _ in results[1:]:
                        assert np.array_equal(out, ref_out) and np.array_equal(lse, ref_lse)
                        assert prefix_len == ref_len
                    (r,) = client.native_verify(layer, [item])
                    check(r, mirror, layer, item, info.default_softmax_scale)
                accepted = root_path(parents, int(rng.integers(0, n)))
                assert client.commit(seq, accepted).length == mirror.layers[0].shape[0] + \
                    len(accepted)
                mirror.commit(drafts, accepted)
        client.release_sequence(seq)
        assert client.unregister_system_shared_memory("py-native") == ["py-native"]


@needs_native
def test_native_repeated_items_follow_every_change(client):
    """The native path remembers a thread's last call (the same item objects
    on every layer): a change of the item's parents, a new q, a q changed in
    place and a region unregistered in between are each seen, as the
    pure-Python path sees them."""
    rng = np.random.default_rng(12)
    info = client.server_info()
    n, heads = 4, info.num_heads
    with SharedMemoryRegion(item_bytes(n, heads)) as region:
        client.register_system_shared_memory("py-native-memo", region)
        seq = client.create_sequence("native-memo")
        client.append_prompt(seq, random_bf16(rng, info.num_layers, 7, 576))
        item = VerifyItem(seq, random_bf16(rng, n, heads, 576), random_bf16(rng, n, 576),
                          [-1, 0, 1, 2], shm=place_item("py-native-memo", 0, n, heads))

        def same_as_pure_python(layer):
            (fast,) = client.native_verify(layer, [item])
            fast_out, fast_lse = np.array(fast.out), np.array(fast.lse)
            (ref,) = client.verify(layer, [item])
            assert np.array_equal(fast_out, ref.out) and np.array_equal(fast_lse, ref.lse)
            return fast_out

        first = same_as_pure_python(0)
        assert np.array_equal(same_as_pure_python(0), first)  # the remembered call
        item.q = random_bf16(rng, n, heads, 576)
        second = same_as_pure_python(0)
        assert not np.array_equal(second, first)
        item.q[...] = random_bf16(rng, n, heads, 576)  # the same object, new values
        assert not np.array_equal(same_as_pure_python(0), second)
        item.draft_kv[...] = random_bf16(rng, n, 576)
        same_as_pure_python(0)
        client.release_sequence(seq)
        seq = client.create_sequence("native-memo-2")
        client.append_prompt(seq, random_bf16(rng, info.num_layers, 7, 576))
        item.sequence_id = seq
        item.parents[1:] = [-1, -1, -1]  # changed in place: a different tree
        same_as_pure_python(0)
        client.unregister_system_shared_memory("py-native-memo")
        with pytest.raises(ValueError, match="not registered"):
            client.native_verify(0, [item])
        client.release_sequence(seq)


@needs_native
def test_bound_items_give_the_results_of_verify(client):
    """A step's items bound once (stream and unary): every layer's results
    equal the pure-Python path's, new contents of the bound q are sent, and
    the bind-time checks, the layer check, a region unregistered or
    registered again and a closed stream each raise before anything is sent."""
    rng = np.random.default_rng(13)
    info = client.server_info()
    n, heads = 3, info.num_heads
    with SharedMemoryRegion(2 * item_bytes(n, heads)) as region:
        client.register_system_shared_memory("py-native-bind", region)
        places = [place_item("py-native-bind", 0, n, heads),
                  place_item("py-native-bind", item_bytes(n, heads), n, heads)]
        seqs = [client.create_sequence(f"native-bind-{k}") for k in range(2)]
        for seq in seqs:
            client.append_prompt(seq, random_bf16(rng, info.num_layers, 9, 576))
        items = [VerifyItem(seq, random_bf16(rng, n, heads, 576), random_bf16(rng, n, 576),
                            random_tree(rng, n), shm=place) for seq, place in zip(seqs, places)]
        with client.native_stream() as fast:
            for bound in (fast.bind(items), client.native_bind(items)):
                for layer in range(info.num_layers):
                    for item in items:
                        item.q[...] = random_bf16(rng, n, heads, 576)  # same object, new values
                    got = [(np.array(r.out), np.array(r.lse), r.prefix_len, r.sequence_id)
                           for r in bound.verify(layer)]
                    want = client.verify(layer, items)
                    for (out, lse, prefix_len, seq), r in zip(got, want):
                        assert np.array_equal(out, r.out) and np.array_equal(lse, r.lse)
                        assert (prefix_len, seq) == (r.prefix_len, r.sequence_id) == \
                            (9, r.sequence_id)
            with pytest.raises(ValueError, match="placed in shared memory only"):
                fast.bind([VerifyItem(seqs[0], items[0].q, items[0].draft_kv, items[0].parents)])
            with pytest.raises(ValueError, match="twice"):
                fast.bind([items[0], items[0]])
            with pytest.raises(ValueError, match="not finite"):
                fast.bind(items, softmax_scale=float("nan"))
            bound = fast.bind(items)
            with pytest.raises(ValueError, match="layer 99"):
                bound.verify(99)
            saved = client._regions["py-native-bind"]
            client.unregister_system_shared_memory("py-native-bind")
            with pytest.raises(ValueError, match="no longer registered"):
                bound.verify(0)
            client.register_system_shared_memory("py-native-bind", region)
            assert client._regions["py-native-bind"] is not saved
            with pytest.raises(ValueError, match="bind them again"):
                bound.verify(0)
            bound = fast.bind(items)
            assert len(bound.verify(0)) == 2
        with pytest.raises(VerifyError) as e:
            bound.verify(0)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(VerifyError) as e:
            fast.bind(items)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        for seq in seqs:
            client.release_sequence(seq)
        client.unregister_system_shared_memory("py-native-bind")


@needs_native
def test_bound_copies_are_waited_for_and_written_in_turn(client, monkeypatch):
    """wait_for_stream=False skips the wait only for what the caller wrote:
    a region whose writes are queued (as a CUDA region's) is still waited
    for when the call copies inputs into it itself, and not when every input
    is the placement's own view; a stream-bound call writes its inputs while
    it holds the stream (threads sharing it take turns)."""
    from mlaverify import _wire
    rng = np.random.default_rng(14)
    info = client.server_info()
    n, heads = 2, info.num_heads
    waits, writes = [], []
    monkeypatch.setattr(_wire.RegisteredView, "writes_are_queued", True)
    monkeypatch.setattr(_wire.RegisteredView, "prepare", lambda view: waits.append(view))
    original_write = _wire.RegisteredView.write
    with SharedMemoryRegion(item_bytes(n, heads)) as region:
        client.register_system_shared_memory("py-native-wait", region)
        seq = client.create_sequence("native-wait")
        client.append_prompt(seq, random_bf16(rng, info.num_layers, 4, 576))
        item = VerifyItem(seq, random_bf16(rng, n, heads, 576), random_bf16(rng, n, 576),
                          [-1, 0], shm=place_item("py-native-wait", 0, n, heads))
        with client.native_stream() as fast:
            def write(view, *args):
                writes.append(fast._lock.locked())
                return original_write(view, *args)
            monkeypatch.setattr(_wire.RegisteredView, "write", write)
            for wait in (False, True):
                bound = fast.bind([item], wait_for_stream=wait)
                waits.clear()
                writes.clear()
                bound.verify(0)
                assert len(waits) == 1, wait  # the region, once: the copies, or the caller's stream
                assert writes == [True, True]  # q and draft_kv, under the stream's lock
            # Every input the placement's own view: nothing to wait for.
            monkeypatch.setattr(_wire.RegisteredView, "in_place", lambda view, *args: True)
            bound = fast.bind([item], wait_for_stream=False)
            waits.clear()
            bound.verify(0)
            assert waits == []
            assert len(fast.bind([item]).verify(0)) == 1 and len(waits) == 1
        client.release_sequence(seq)
        client.unregister_system_shared_memory("py-native-wait")


@needs_native
def test_native_checks_and_in_band_errors(client):
    """The client-side checks raise before anything is sent; a server error
    on the native stream raises VerifyError with its code and the stream
    goes on."""
    rng = np.random.default_rng(12)
    info = client.server_info()
    n, heads = 2, info.num_heads
    with SharedMemoryRegion(item_bytes(n, heads)) as region:
        client.register_system_shared_memory("py-native-err", region)
        place = place_item("py-native-err", 0, n, heads)
        seq = client.create_sequence("native-err")
        client.append_prompt(seq, random_bf16(rng, info.num_layers, 5, 576))
        q, kv = random_bf16(rng, n, heads, 576), random_bf16(rng, n, 576)
        item = VerifyItem(seq, q, kv, [-1, 0], shm=place)
        with client.native_stream() as fast:
            with pytest.raises(ValueError, match="placed in shared memory only"):
                fast.verify(0, [VerifyItem(seq, q, kv, [-1, 0])])
            with pytest.raises(ValueError, match="layer 99"):
                fast.verify(99, [item])
            with pytest.raises(ValueError, match="parents"):
                fast.verify(0, [VerifyItem(seq, q, kv, [-1, 5], shm=place)])
            with pytest.raises(ValueError, match="q"):
                fast.verify(0, [VerifyItem(seq, q[:, :1], kv, [-1, 0], shm=place)])
            # A sequence the server does not know: NOT_FOUND in band.
            with pytest.raises(VerifyError) as e:
                fast.verify(0, [VerifyItem(seq + 1000, q, kv, [-1, 0], shm=place)])
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            # A region the server does not know (registered only here): NOT_FOUND.
            client._regions["py-native-gone"] = client._regions["py-native-err"]
            gone = place_item("py-native-gone", 0, n, heads)
            with pytest.raises(VerifyError) as e:
                client.native_verify(0, [VerifyItem(seq, q, kv, [-1, 0], shm=gone)])
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            del client._regions["py-native-gone"]
            (r,) = fast.verify(0, [item])  # the stream goes on
            assert r.prefix_len == 5
        with pytest.raises(VerifyError) as e:
            fast.verify(0, [item])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        client.release_sequence(seq)
        client.unregister_system_shared_memory("py-native-err")


@needs_native
def test_closing_the_client_ends_its_native_streams(server):
    from mlaverify import VerifyClient
    with VerifyClient(server) as c:
        stream = c.native_stream()
    with pytest.raises(VerifyError) as e:
        stream.verify(0, [])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    stream.close()  # nothing left to close
    with pytest.raises(ValueError, match="closed"):
        c.native_stream()


def test_absent_library_says_so():
    """Where the library is not there, the native calls raise
    NativeUnavailableError naming the path and the pure-Python way."""
    code = (
        "from mlaverify import VerifyClient, native\n"
        "assert not native.available()\n"
        "c = VerifyClient('127.0.0.1:1')\n"
        "for call in (c.native_stream, lambda: c.native_verify(0, [])):\n"
        "    try:\n"
        "        call()\n"
        "    except native.NativeUnavailableError as e:\n"
        "        print(e)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n")
    env = dict(os.environ, MLAVERIFY_NATIVE_LIB="/nonexistent/libmlaverify_native.so")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "/nonexistent/libmlaverify_native.so" in line
        assert "pure-Python path" in line and "build/client/python" in line


@needs_native
def test_native_calls_take_their_own_metadata_and_timeout():
    """A native call's metadata replaces the client's pairs of its keys (a
    wrong per-call token is refused where the client's own passes), a native
    stream sends its metadata with its opening, and a native call's own
    timeout bounds it."""
    import signal
    import tempfile
    import time
    from conftest import start_server, stop_server
    from mlaverify import VerifyClient
    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        f.write("n4tive-token\n")
    proc, target, log = start_server(["--auth-token-file", f.name])
    try:
        with VerifyClient(target, auth_token="n4tive-token", timeout=30) as c:
            rng = np.random.default_rng(21)
            info = c.server_info()
            n, heads = 2, info.num_heads
            with SharedMemoryRegion(item_bytes(n, heads)) as region:
                c.register_system_shared_memory("py-native-md", region)
                seq = c.create_sequence("native-md")
                c.append_prompt(seq, random_bf16(rng, info.num_layers, 4, 576))
                item = VerifyItem(seq, random_bf16(rng, n, heads, 576), random_bf16(rng, n, 576),
                                  [-1, 0], shm=place_item("py-native-md", 0, n, heads))
                wrong = [("authorization", "Bearer not-it")]
                with pytest.raises(VerifyError) as e:
                    c.native_verify(0, [item], metadata=wrong)
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                (r,) = c.native_verify(0, [item], metadata=[("x-trace", "1")])
                assert r.prefix_len == 4
                bound = c.native_bind([item])
                with pytest.raises(VerifyError) as e:
                    bound.verify(1, metadata=wrong)
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                # A server that stops answering: the call's own 0.2 s bounds it,
                # not the client's 30 s.
                proc.send_signal(signal.SIGSTOP)
                try:
                    # SIGSTOP takes effect asynchronously: wait until every
                    # thread is stopped, or a call could still be answered.
                    for _ in range(500):
                        tasks = f"/proc/{proc.pid}/task"
                        states = [open(f"{tasks}/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                                  for t in os.listdir(tasks)]
                        if all(st == "T" for st in states):
                            break
                        time.sleep(0.01)
                    started = time.monotonic()
                    with pytest.raises(VerifyError) as e:
                        bound.verify(1, timeout=0.2)
                    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert time.monotonic() - started < 5
                finally:
                    proc.send_signal(signal.SIGCONT)
                with pytest.raises(ValueError, match="timeout"):
                    c.native_verify(1, [item], timeout=0)
                refused = c.native_stream(metadata=wrong)
                with pytest.raises(VerifyError) as e:
                    refused.verify(1, [item])
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(ValueError, match="stream message"):
                    refused.bind([item]).verify(1, metadata=wrong)
                with pytest.raises(VerifyError) as e:
                    refused.close()  # the server's final status
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                with c.native_stream(metadata=[("x-trace", "2")]) as fast:
                    (r,) = fast.verify(1, [item])
                    assert r.prefix_len == 4
                c.release_sequence(seq)
                c.unregister_system_shared_memory("py-native-md")
    finally:
        assert stop_server(proc) == 0, open(log).read()
        os.unlink(f.name)
