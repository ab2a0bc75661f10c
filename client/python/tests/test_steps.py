"""Device-driven steps from Python (mlaverify.steps) against the CPU server:
host doorbells in a system region, every layer rung and awaited with no call
per layer, its outputs in the region checked against the NumPy reference,
then Commit; an aborted step's waits raise ABORTED and change nothing; bad
steps get the server's codes; the asyncio client opens steps too. (GPU
doorbells: test_cuda_shm.py, on a GPU machine.)"""

import asyncio

import grpc
import numpy as np
import pytest

from mlaverify import (SharedMemoryRegion, StepItemPlacement, StepRank, StepTensor, VerifyError,
                       VerifyItem, VerifyResult, place_item)
from mlaverify.aio import AsyncVerifyClient
from mlaverify.shm import item_bytes
from mlaverify.steps import SLOT_BYTES

from test_client import Mirror, check, random_bf16, random_tree, root_path


def step_layout(info, n, items):
    """Per item a place_item placement (one place for every layer) and the
    two slots after them: (region size, placements, doorbell, completion)."""
    per_item = item_bytes(n, info.num_heads)
    places = [place_item("py-steps", k * per_item, n, info.num_heads) for k in range(items)]
    slots = items * per_item
    return slots + 2 * SLOT_BYTES, places, slots, slots + SLOT_BYTES


def result_of(region, place, seq, n, heads, prefix):
    out = region.array(place.out_offset, np.uint16, (n, heads, 512)).copy()
    lse = region.array(place.lse_offset, np.float32, (n, heads)).copy()
    return VerifyResult(seq, out, lse, prefix)


def test_host_doorbell_steps_match_the_reference(client):
    rng = np.random.default_rng(11)
    info = client.server_info()
    assert info.host_doorbells and not info.gpu_doorbells and info.step_lanes_per_device > 0
    n, heads, layers = 5, info.num_heads, info.num_layers
    size, places, doorbell, completion = step_layout(info, n, 2)
    with SharedMemoryRegion(size) as region:
        client.register_system_shared_memory("py-steps", region)
        seqs, mirrors = [], []
        for prompt_len in (20, 7):
            seq = client.create_sequence("py-steps")
            mirror = Mirror(layers)
            prompt = random_bf16(rng, layers, prompt_len, 576)
            client.append_prompt(seq, prompt)
            mirror.append_prompt(prompt)
            seqs.append(seq)
            mirrors.append(mirror)
        rank = StepRank([StepItemPlacement.of(p) for p in places], "py-steps", doorbell, completion)
        for _ in range(2):
            trees = [random_tree(rng, n) for _ in seqs]
            drafts = [[random_bf16(rng, n, 576) for _ in range(layers)] for _ in seqs]
            step = client.open_step(list(zip(seqs, trees)), [rank])
            assert step.prefix_len == [m.layers[0].shape[0] for m in mirrors]
            for layer in range(layers):
                items = []
                for k, seq in enumerate(seqs):
                    q = random_bf16(rng, n, heads, 576)
                    region.array(places[k].q_offset, np.uint16, (n, heads, 576))[...] = q
                    region.array(places[k].draft_kv_offset, np.uint16, (n, 576))[...] = \
                        drafts[k][layer]
                    items.append(VerifyItem(seq, q, drafts[k][layer], trees[k]))
                step.ring(0, layer + 1)
                step.wait(0, layer + 1)
                for k, seq in enumerate(seqs):
                    result = result_of(region, places[k], seq, n, heads, step.prefix_len[k])
                    check(result, mirrors[k], layer, items[k], info.default_softmax_scale)
            assert step.completed(0) == layers
            for k, seq in enumerate(seqs):
                path = root_path(trees[k], n - 1) if k == 0 else []
                assert client.commit(seq, path).length == mirrors[k].layers[0].shape[0] + len(path)
                mirrors[k].commit(drafts[k], path)
        # Aborted after one layer: the waits end ABORTED, the sequence is as before.
        step = client.open_step([(seqs[0], random_tree(rng, n))], [StepRank(
            [StepItemPlacement.of(places[0])], "py-steps", doorbell, completion)])
        step.ring(0, 1)
        step.wait(0, 1)
        status = step.abort()
        assert (status.state, status.abort_reason) == ("aborted", "abort_call")
        assert status.error_code == grpc.StatusCode.ABORTED.value[0]
        with pytest.raises(VerifyError) as e:
            step.wait(0, layers)
        assert e.value.code == grpc.StatusCode.ABORTED
        assert client.get_step(step.step_id).state == "aborted"
        with pytest.raises(VerifyError) as e:
            client.commit(seqs[0], [0])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        # Bad steps: the server's codes; GPU doorbells need the CUDA backend.
        q = StepTensor("nope", 0)
        wrong = StepRank([StepItemPlacement(q, q, q, q)], "py-steps", doorbell, completion)
        for ranks, doorbell_kind, code in (([wrong], "host", grpc.StatusCode.NOT_FOUND),
                                           ([rank], "gpu", grpc.StatusCode.FAILED_PRECONDITION),
                                           ([rank, rank], "host", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(VerifyError) as e:
                client.open_step([(seqs[0], [-1, 0])], ranks, doorbell=doorbell_kind)
            assert e.value.code == code, e.value
        for seq in seqs:
            client.release_sequence(seq)
        assert client.unregister_system_shared_memory("py-steps") == ["py-steps"]


def test_asyncio_client_opens_steps(server):
    async def run():
        rng = np.random.default_rng(12)
        async with AsyncVerifyClient(server, timeout=30) as c:
            info = await c.server_info()
            n = 2
            size, places, doorbell, completion = step_layout(info, n, 1)
            with SharedMemoryRegion(size) as region:
                await c.register_system_shared_memory("py-steps", region)
                seq = await c.create_sequence("py-aio-steps")
                await c.append_prompt(seq, random_bf16(rng, info.num_layers, 9, 576))
                step = await c.open_step([(seq, [-1, 0])], [StepRank(
                    [StepItemPlacement.of(places[0])], "py-steps", doorbell, completion)])
                for layer in range(info.num_layers):
                    step.ring(0, layer + 1)
                    step.wait(0, layer + 1)
                assert (await c.commit(seq, [0])).length == 10
                assert (await step.status()).state == "committed"
                await c.release_sequence(seq)
                assert await c.unregister_system_shared_memory("py-steps") == ["py-steps"]

    asyncio.run(run())
