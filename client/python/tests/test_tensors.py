"""bf16 conversion and tensor packing, without a server."""

import numpy as np
import pytest

from mlaverify import tensors
from mlaverify.v1 import verify_pb2


def test_bf16_round_trip_is_exact_for_bf16_values():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    f = tensors.float32_from_bf16(bits)
    finite = np.isfinite(f)
    back = tensors.bf16_from_float32(f)
    assert np.array_equal(back[finite], bits[finite])
    assert np.isnan(tensors.float32_from_bf16(back[np.isnan(f)])).all()


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties go to even (1.0).
    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -1.0 - 2.0 ** -9], dtype=np.float32)
    got = tensors.float32_from_bf16(tensors.bf16_from_float32(x))
    assert got.tolist() == [1.0, 1.0 + 2.0 ** -6, -1.0]


def test_to_proto_checks_dtype_and_shape():
    a = np.zeros((2, 576), dtype=np.uint16)
    t = tensors.to_proto(a, tensors.BF16, [2, 576], "draft_kv")
    assert t.dtype == verify_pb2.DTYPE_BF16 and list(t.shape) == [2, 576] and len(t.raw) == 2304
    with pytest.raises(TypeError, match="bf16_from_float32"):
        tensors.to_proto(a.astype(np.float32), tensors.BF16, [2, 576], "draft_kv")
    with pytest.raises(ValueError, match=r"expected shape \[3, 576\], got \[2, 576\]"):
        tensors.to_proto(a, tensors.BF16, [3, 576], "draft_kv")


def test_from_proto_checks_what_the_server_sent():
    t = verify_pb2.Tensor(dtype=verify_pb2.DTYPE_FP32, shape=[2, 3], raw=b"\0" * 24)
    assert tensors.from_proto(t, tensors.FP32, [2, 3], "lse").shape == (2, 3)
    with pytest.raises(ValueError, match="shape"):
        tensors.from_proto(t, tensors.FP32, [3, 2], "lse")
    t.raw = b"\0" * 20
    with pytest.raises(ValueError, match="20 bytes, expected 24"):
        tensors.from_proto(t, tensors.FP32, [2, 3], "lse")


@pytest.mark.skipif(not tensors.torch_available(), reason="torch is not importable")
def test_torch_bf16_tensors_carry_the_same_bits():
    import torch
    x = torch.randn(3, 576).to(torch.bfloat16)
    t = tensors.to_proto(x, tensors.BF16, [3, 576], "draft_kv")
    bits = np.frombuffer(t.raw, dtype=np.uint16).reshape(3, 576)
    assert np.array_equal(bits, tensors.bf16_from_float32(x.float().numpy()))
    back = tensors.from_proto(t, tensors.BF16, [3, 576], "draft_kv", tensors.Output(torch=True))
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


def test_fp8_rounding_matches_the_e4m3_grid():
    from mlaverify.reference import e4m3_round, fp8_stored
    # Every finite e4m3 magnitude: subnormals k * 2^-9, normals (1 + m/8) 2^e.
    grid = sorted({k * 2.0 ** -9 for k in range(8)} |
                  {(1 + m / 8) * 2.0 ** e for e in range(-6, 9) for m in range(8)
                   if (1 + m / 8) * 2.0 ** e <= 448})
    g = np.array(grid, dtype=np.float32)
    assert np.array_equal(e4m3_round(g), g) and np.array_equal(e4m3_round(-g), -g)
    mids = ((g[:-1].astype(np.float64) + g[1:]) / 2).astype(np.float32)
    codes = np.arange(len(g) - 1)
    want = np.where(codes % 2 == 0, g[:-1], g[1:])     # ties to the even code
    assert np.array_equal(e4m3_round(mids), want)
    assert e4m3_round(np.array([1e9, 449.0, 447.0], dtype=np.float32)).tolist() == [448, 448, 448]
    # A row: group amax maps to 448 * scale exactly; rope columns untouched.
    rng = np.random.default_rng(3)
    row = rng.standard_normal(576).astype(np.float32)
    row[130] = 9.0
    stored = fp8_stored(row)
    assert stored[130] == np.float32(np.float32(9.0 / 448) * 448)
    assert np.array_equal(stored[512:], row[512:])
    assert np.abs(stored[:512] - row[:512]).max() <= np.abs(row[:512]).max() / 16
    assert np.array_equal(fp8_stored(np.zeros(576, np.float32)), np.zeros(576, np.float32))
