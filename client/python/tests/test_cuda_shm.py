"""CUDA shared memory with torch tensors. Without a GPU: the handle torch
exports is read in each of its formats, requests reference the region at
the allocation's offsets with the inputs written there, results are views
of the region, and a CPU server refuses the registration with
FAILED_PRECONDITION. With a GPU and a server built with CUDA
(MLAVERIFY_CUDA_TESTS=1, tests/python_cuda_shm_gpu.sh): decode steps
through CUDA regions match the reference, results land in place, also
through the native path."""

import os

import grpc
import numpy as np
import pytest

from mlaverify import (CudaSharedMemoryRegion, VerifyClient, VerifyError, VerifyItem,
                       bf16_from_float32, place_item, tensors)
from mlaverify.client import cuda_shm_request
from mlaverify.cuda_shm import CudaRegisteredView, cuda_ipc_handle
from mlaverify.reference import relative_error, verify_reference
from mlaverify.shm import item_bytes
from mlaverify.v1 import verify_pb2

from conftest import start_server, stop_server

torch = pytest.importorskip("torch", reason="torch is not importable")

HANDLE = bytes(range(64))


def test_ipc_handle_formats():
    assert cuda_ipc_handle(HANDLE) == HANDLE                  # torch < 2.4: the handle
    assert cuda_ipc_handle(b"\x02c" + HANDLE) == HANDLE       # version 2, cudaMalloc block
    assert cuda_ipc_handle(b"\x03c" + HANDLE) == HANDLE       # a later version, same payload
    with pytest.raises(ValueError, match="expandable_segments:False"):
        cuda_ipc_handle(b"\x02e" + HANDLE + b"more")
    with pytest.raises(ValueError, match="not a cudaIpcMemHandle_t"):
        cuda_ipc_handle(HANDLE[:40])


def fake_region(size, base_offset=4096):
    """A region over CPU memory with a made-up handle: what the request
    builder sees of a CUDA region, minus the device."""
    return CudaSharedMemoryRegion._of(torch.zeros(size, dtype=torch.uint8), HANDLE, base_offset,
                                      device_index=3)


def bf16_torch(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.5).to(torch.bfloat16)


def test_requests_reference_the_allocation_and_results_are_views(client):
    rng = np.random.default_rng(0)
    g = client.geometry
    n, h = 3, g.num_heads
    region = fake_region(2 * item_bytes(n, h))
    client._regions["gpu"] = CudaRegisteredView(region)
    try:
        place = place_item("gpu", 0, n, h)
        views = region.item_views(place)
        assert views.q.data_ptr() == region.tensor.data_ptr() + place.q_offset
        # q written in place by the caller (no copy), draft_kv copied in from NumPy bits.
        q = bf16_torch(rng, n, h, 576)
        views.q.copy_(q)
        kv_bits = bf16_from_float32(rng.standard_normal((n, 576)).astype(np.float32))
        request = g.verify_request(0, [VerifyItem(7, views.q, kv_bits, [-1, 0, 1], shm=place)],
                                   0.0, 1)
        item = request.items[0]
        assert item.q.shared_memory == verify_pb2.SharedMemoryRef(
            region="gpu", offset=4096 + place.q_offset, byte_size=n * h * 576 * 2)
        assert item.draft_kv.shared_memory.offset == 4096 + place.draft_kv_offset
        assert item.out_shared_memory.offset == 4096 + place.out_offset
        assert item.lse_shared_memory == verify_pb2.SharedMemoryRef(
            region="gpu", offset=4096 + place.lse_offset, byte_size=n * h * 4)
        assert torch.equal(views.q, q)
        assert np.array_equal(views.draft_kv.view(torch.int16).numpy().view(np.uint16), kv_bits)
        # A torch tensor that is not the placement's memory is copied in.
        other = bf16_torch(rng, n, h, 576)
        g.verify_request(0, [VerifyItem(7, other, kv_bits, [-1, 0, 1], shm=place)], 0.0, 2)
        assert torch.equal(views.q, other)
        # The answer: out and lse where they were placed; results are views.
        views.out.copy_(bf16_torch(rng, n, h, 512))
        views.lse.copy_(torch.arange(n * h, dtype=torch.float32).view(n, h))
        response = verify_pb2.VerifyResponse(results=[verify_pb2.VerifyResult(
            sequence_id=7, prefix_len=5,
            out=verify_pb2.Tensor(dtype=verify_pb2.DTYPE_BF16, shape=[n, h, 512],
                                  shared_memory=item.out_shared_memory),
            lse=verify_pb2.Tensor(dtype=verify_pb2.DTYPE_FP32, shape=[n, h],
                                  shared_memory=item.lse_shared_memory))])
        (result,) = g.verify_results(request, response, tensors.Output())
        assert result.out.dtype == torch.bfloat16 and result.out.data_ptr() == views.out.data_ptr()
        assert result.lse.data_ptr() == views.lse.data_ptr() and result.lse[1, 0] == h
        # Wrong dtype or shape of an input: refused before anything is sent.
        with pytest.raises(TypeError, match="bfloat16"):
            g.verify_request(0, [VerifyItem(7, other.float(), kv_bits, [-1, 0, 1], shm=place)],
                             0.0, 3)
        with pytest.raises(ValueError, match="shape"):
            g.verify_request(0, [VerifyItem(7, other[:2], kv_bits, [-1, 0, 1], shm=place)], 0.0, 4)
    finally:
        del client._regions["gpu"]


def test_register_request_and_a_cpu_servers_refusal(client):
    region = fake_region(1 << 16, base_offset=512)
    r = cuda_shm_request("gpu-0", region, None)
    assert (r.raw_handle, r.device_id, r.byte_size) == (HANDLE, 3, 512 + (1 << 16))
    assert cuda_shm_request("gpu-0", region, 0).device_id == 0
    with pytest.raises(TypeError, match="CudaSharedMemoryRegion"):
        cuda_shm_request("gpu-0", object(), None)
    with pytest.raises(VerifyError) as e:
        client.register_cuda_shared_memory("gpu-0", region)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "gpu-0" not in client._regions and client.cuda_shared_memory_status() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_no_cuda_device_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaSharedMemoryRegion(1024)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaSharedMemoryRegion.from_tensor(torch.zeros(4))


# --- on a GPU, against a server built with CUDA --------------------------

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and os.environ.get("MLAVERIFY_CUDA_TESTS")),
    reason="needs a CUDA device and MLAVERIFY_CUDA_TESTS=1 (a server built with CUDA: "
           "tests/python_cuda_shm_gpu.sh)")


@pytest.fixture
def cuda_server():
    proc, target, log = start_server(backend="cuda")
    yield target
    assert stop_server(proc) == 0, open(log).read()


def check_against_reference(result, committed, q, draft_kv, parents, scale):
    want_out, want_lse = verify_reference(committed.float().cpu().numpy(), q.float().cpu().numpy(),
                                          draft_kv.float().cpu().numpy(), parents, scale)
    assert relative_error(result.out.float().cpu().numpy(), want_out) <= 1e-2
    assert np.abs(result.lse.cpu().numpy() - want_lse).max() <= 1e-2


@gpu
def test_decode_steps_through_cuda_regions(cuda_server):
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    with VerifyClient(cuda_server, timeout=60) as client:
        info = client.server_info()
        assert info.backend == "cuda"
        L, H, n = info.num_layers, info.num_heads, 4
        parents = [-1, 0, 0, 1]
        region = CudaSharedMemoryRegion(2 * item_bytes(n, H), device=dev)
        # The memory of a tensor the caller already has, as a second region.
        buffer = torch.zeros(item_bytes(n, H) // 2 + 64, dtype=torch.bfloat16, device=dev)
        theirs = CudaSharedMemoryRegion.from_tensor(buffer)
        client.register_cuda_shared_memory("py-gpu", region)
        client.register_cuda_shared_memory("py-gpu-theirs", theirs)
        places = [place_item("py-gpu", 0, n, H), place_item("py-gpu-theirs", 0, n, H)]
        regions = [region, theirs]
        seq = client.create_sequence("cuda-shm")
        prompt = torch.randn(L, 40, 576, device=dev).to(torch.bfloat16)
        client.append_prompt(seq, prompt)  # a CUDA tensor inline
        committed = [prompt[layer] for layer in range(L)]
        with client.verify_stream() as stream:
            for step in range(2):
                drafts = [torch.randn(n, 576, device=dev).to(torch.bfloat16) for _ in range(L)]
                for layer in range(L):
                    k = (step + layer) % 2
                    views = regions[k].item_views(places[k])
                    q = torch.randn(n, H, 576, device=dev).to(torch.bfloat16)
                    views.q.copy_(q)  # written in place, on the current stream
                    call = client.verify if layer % 2 == 0 else stream.verify
                    (r,) = call(layer, [VerifyItem(seq, views.q, drafts[layer], parents,
                                                   shm=places[k])])
                    assert r.out.device == dev and r.out.data_ptr() == views.out.data_ptr()
                    assert r.lse.data_ptr() == views.lse.data_ptr()
                    check_against_reference(r, committed[layer], q, drafts[layer], parents,
                                            info.default_softmax_scale)
                accepted = [0, 1, 3] if step == 0 else []
                client.commit(seq, accepted)
                committed = [torch.cat([c, d[accepted]]) for c, d in zip(committed, drafts)]
        status = {s.name: s for s in client.cuda_shared_memory_status()}
        assert status["py-gpu"].calls_total + status["py-gpu-theirs"].calls_total == 2 * L
        assert status["py-gpu"].device_id == 0
        assert sorted(client.unregister_cuda_shared_memory("")) == ["py-gpu", "py-gpu-theirs"]
        region.close()
        theirs.close()
        client.release_sequence(seq)


@gpu
def test_native_path_through_a_cuda_region(cuda_server):
    """The native path (mlaverify.native) with a CUDA region: inputs used in
    place, results views of the region, answers matching the reference, over
    native unary calls and a native stream alternately; then a step of items
    bound once (NativeVerifyStream.bind, wait_for_stream=False): q written
    in place by the caller, who synchronizes its own writes, draft_kv a
    tensor outside the region whose new contents the bound call copies in
    itself (queued on the current stream, and waited for by the call)."""
    from mlaverify import native
    if not native.available():
        pytest.skip("no native library (mlaverify/lib/libmlaverify_native.so)")
    torch.manual_seed(1)
    dev = torch.device("cuda", 0)
    with VerifyClient(cuda_server, timeout=60) as client:
        info = client.server_info()
        L, H, n = info.num_layers, info.num_heads, 3
        parents = [-1, 0, 0]
        region = CudaSharedMemoryRegion(item_bytes(n, H), device=dev)
        client.register_cuda_shared_memory("py-gpu-native", region)
        place = place_item("py-gpu-native", 0, n, H)
        views = region.item_views(place)
        seq = client.create_sequence("cuda-shm-native")
        prompt = torch.randn(L, 33, 576, device=dev).to(torch.bfloat16)
        client.append_prompt(seq, prompt)
        drafts = [torch.randn(n, 576, device=dev).to(torch.bfloat16) for _ in range(L)]
        with client.native_stream() as stream:
            for layer in range(L):
                q = torch.randn(n, H, 576, device=dev).to(torch.bfloat16)
                views.q.copy_(q)
                call = client.native_verify if layer % 2 == 0 else stream.verify
                (r,) = call(layer, [VerifyItem(seq, views.q, drafts[layer], parents, shm=place)])
                assert r.out.data_ptr() == views.out.data_ptr() and r.prefix_len == 33
                assert r.lse.data_ptr() == views.lse.data_ptr()
                check_against_reference(r, prompt[layer], q, drafts[layer], parents,
                                        info.default_softmax_scale)
        (status,) = client.cuda_shared_memory_status("py-gpu-native")
        assert status.calls_total == L
        client.commit(seq, [])
        draft_kv = torch.empty(n, 576, device=dev, dtype=torch.bfloat16)
        item = VerifyItem(seq, views.q, draft_kv, parents, shm=place)
        with client.native_stream() as stream:
            bound = stream.bind([item], wait_for_stream=False)
            for layer in range(L):
                q = torch.randn(n, H, 576, device=dev).to(torch.bfloat16)
                views.q.copy_(q)
                draft_kv.copy_(drafts[layer])
                torch.cuda.current_stream(dev).synchronize()  # the caller orders its writes
                (r,) = bound.verify(layer)
                assert r.out.data_ptr() == views.out.data_ptr() and r.prefix_len == 33
                check_against_reference(r, prompt[layer], q, drafts[layer], parents,
                                        info.default_softmax_scale)
        client.commit(seq, [])
        client.release_sequence(seq)
        assert client.unregister_cuda_shared_memory("py-gpu-native") == ["py-gpu-native"]
        region.close()


@gpu
def test_cuda_results_inline(cuda_server):
    """Inline plane, results as torch tensors on the caller's device."""
    dev = torch.device("cuda", 0)
    with VerifyClient(cuda_server, device=dev) as client:
        info = client.server_info()
        seq = client.create_sequence()
        prompt = torch.randn(info.num_layers, 20, 576, device=dev).to(torch.bfloat16)
        client.append_prompt(seq, prompt)
        q = torch.randn(2, info.num_heads, 576, device=dev).to(torch.bfloat16)
        kv = torch.randn(2, 576, device=dev).to(torch.bfloat16)
        (r,) = client.verify(0, [VerifyItem(seq, q, kv, [-1, 0])])
        assert r.out.device == dev and r.out.dtype == torch.bfloat16 and r.lse.device == dev
        check_against_reference(r, prompt[0], q, kv, [-1, 0], info.default_softmax_scale)
        client.commit(seq, [])
        client.release_sequence(seq)


def test_results_on_the_device_the_caller_names(server):
    """device= gives torch tensors there (the CPU here; cuda:0 on a GPU, in
    test_cuda_results_inline); the default stays NumPy."""
    rng = np.random.default_rng(5)
    with VerifyClient(server, device="cpu") as client:
        g = client.geometry
        seq = client.create_sequence()
        client.append_kv(seq, 0, bf16_torch(rng, g.num_layers, 6, 576))
        q, kv = bf16_torch(rng, 2, g.num_heads, 576), bf16_torch(rng, 2, 576)
        (r,) = client.verify(0, [VerifyItem(seq, q, kv, [-1, 0])])
        assert isinstance(r.out, torch.Tensor) and r.out.dtype == torch.bfloat16
        assert r.lse.dtype == torch.float32 and r.out.device.type == "cpu"
        client.commit(seq, [])
        client.release_sequence(seq)
    with VerifyClient(server) as client:
        seq = client.create_sequence()
        client.append_kv(seq, 0, bf16_torch(rng, g.num_layers, 6, 576))
        (r,) = client.verify(0, [VerifyItem(seq, q, kv, [-1, 0])])
        assert isinstance(r.out, np.ndarray) and r.out.dtype == np.uint16
        client.commit(seq, [])
        client.release_sequence(seq)
