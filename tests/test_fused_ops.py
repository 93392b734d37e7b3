"""The fused decoder-layer ops (rms_norm, rotary, silu_mul, kv_write) against their references."""

from __future__ import annotations

import pytest
import torch

from specinfer import ops
from specinfer.layers import RotaryEmbedding

_C = pytest.importorskip("specinfer._C")

DTYPES = [torch.float32, torch.bfloat16]


def close(dtype: torch.dtype) -> dict:
    """float32: a few ulp (other summation order, exp approximation); bfloat16: the fp32 scale
    may round the other way, which moves an output by one bfloat16 ulp."""
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576,), (1, 1, 576), (3, 5, 64), (2, 130), (2, 9, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, shape, with_residual):
    x = randn(*shape, dtype=dtype, scale=3.0)
    weight = randn(shape[-1], dtype=dtype, seed=1)
    residual = randn(*shape, dtype=dtype, seed=2) if with_residual else None
    expected_residual = residual.clone() if with_residual else None
    got = ops.rms_norm(x, weight, 1e-5, residual)
    expected = ops.rms_norm_reference(x, weight, 1e-5, expected_residual)
    torch.testing.assert_close(got, expected, **close(dtype))
    if with_residual:  # the sum is rounded once, exactly as torch rounds it
        assert torch.equal(residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype):
    base = randn(4, 3, 100, dtype=dtype)
    x = base[:, :, 10:74]  # rows 100 elements apart
    residual = randn(4, 3, 80, dtype=dtype, seed=1)[..., :64]
    expected_residual = residual.clone()
    weight = randn(64, dtype=dtype, seed=2)
    got = ops.rms_norm(x, weight, 1e-6, residual)
    expected = ops.rms_norm_reference(x, weight, 1e-6, expected_residual)
    torch.testing.assert_close(got, expected, **close(dtype))
    assert torch.equal(residual, expected_residual)


def qkv_views(batch, tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k as the model makes them: views into one fused projection output."""
    qkv = randn(batch, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.view(batch, tokens, -1, head_dim).split_with_sizes(
        [heads, kv_heads, kv_heads], dim=2
    )
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", [torch.float32, "model"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "shape", [(1, 1, 9, 3, 64), (3, 7, 4, 4, 32), (2, 5, 8, 2, 128), (2, 16, 9, 3, 64)]
)
def test_rotary(dtype, table_dtype, index_dtype, shape):
    batch, tokens, heads, kv_heads, head_dim = shape
    rotary = RotaryEmbedding(head_dim, 300, 10000.0, None)
    table = dtype if table_dtype == "model" else table_dtype
    cos, sin = rotary.cos.to(table), rotary.sin.to(table)
    positions = torch.randint(0, 300, (batch, tokens), generator=torch.Generator().manual_seed(3))
    positions = positions.to(index_dtype)
    q, k = qkv_views(batch, tokens, heads, kv_heads, head_dim, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary(q, k, cos, sin, positions)
    ops.rotary_reference(q_ref, k_ref, cos, sin, positions)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 3072), (4, 3, 20), (7, 2), (3, 4, 3072)])
@pytest.mark.parametrize("scale", [1.0, 100.0])  # 100: exp's clamps, silu ~ 0 or ~ x
def test_silu_mul(dtype, shape, scale):
    x = randn(*shape, dtype=dtype, scale=scale)
    torch.testing.assert_close(ops.silu_mul(x), ops.silu_mul_reference(x), **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_between_threads_equal_one_row_calls(dtype):
    """Calls this large split their rows between the threads (fused.cpp: for_row_ranges): each
    row must come out bit for bit as it does alone, as a tree's rows must equal decode steps."""
    x, weight = randn(24, 576, dtype=dtype, scale=3.0), randn(576, dtype=dtype, seed=1)
    residual = randn(24, 576, dtype=dtype, seed=2)
    rows_residual = residual.clone()
    whole = ops.rms_norm(x, weight, 1e-5, residual)
    for r in range(24):
        one = ops.rms_norm(x[r : r + 1], weight, 1e-5, rows_residual[r : r + 1])
        assert torch.equal(one, whole[r : r + 1])
    assert torch.equal(rows_residual, residual)

    gate_up = randn(24, 3072, dtype=dtype, scale=4.0, seed=3)
    whole = ops.silu_mul(gate_up)
    assert all(torch.equal(ops.silu_mul(gate_up[r : r + 1]), whole[r : r + 1]) for r in range(24))

    rotary = RotaryEmbedding(64, 300, 10000.0, None)
    positions = torch.arange(100, 124).view(1, 24)
    q, k = qkv_views(1, 24, 9, 3, 64, dtype)
    q_rows, k_rows = q.clone(), k.clone()
    ops.rotary(q, k, rotary.cos, rotary.sin, positions)
    for t in range(24):
        ops.rotary(q_rows[:, t : t + 1], k_rows[:, t : t + 1], rotary.cos, rotary.sin,
                   positions[:, t : t + 1])  # fmt: skip
    assert torch.equal(q, q_rows) and torch.equal(k, k_rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_strided_rows(dtype):
    x = randn(5, 40, dtype=dtype)[:, 4:36]
    torch.testing.assert_close(ops.silu_mul(x), ops.silu_mul_reference(x), **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "seq_major"])
def test_kv_write(dtype, index_dtype, layout):
    rows, kv_heads, seq, head_dim, batch, tokens = 5, 3, 20, 64, 3, 4
    if layout == "seq_major":  # [rows, seq, kv_heads, D] viewed as [rows, kv_heads, seq, D]
        caches = [randn(rows, seq, kv_heads, head_dim, dtype=dtype, seed=s).transpose(1, 2)
                  for s in (1, 2)]  # fmt: skip
    else:
        caches = [randn(rows, kv_heads, seq, head_dim, dtype=dtype, seed=s) for s in (1, 2)]
    expected = [c.clone() for c in caches]
    k = randn(batch, tokens, kv_heads, head_dim, dtype=dtype, seed=3)
    v = randn(batch, tokens, kv_heads, head_dim, dtype=dtype, seed=4)
    cache_rows = torch.tensor([4, 0, 2], dtype=index_dtype)
    slots = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10], [16, 17, 18, 19]], dtype=index_dtype)
    ops.kv_write(*caches, k, v, cache_rows, slots)
    ops.kv_write_reference(*expected, k, v, cache_rows, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_other_dtypes_and_cache_dtypes_use_the_reference():
    x = randn(2, 64, dtype=torch.float16)
    w = randn(64, dtype=torch.float16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm_reference(x, w, 1e-5))
    assert torch.equal(ops.silu_mul(x), ops.silu_mul_reference(x))
    caches = [torch.zeros(2, 1, 4, 8) for _ in range(2)]  # a float32 cache for bfloat16 k/v
    k = randn(1, 1, 1, 8, dtype=torch.bfloat16)
    ops.kv_write(*caches, k, k, torch.tensor([1]), torch.tensor([[2]]))
    assert torch.equal(caches[0][1, :, 2], k[0, 0].float())


def test_any_dlpack_producer_and_requires_grad():
    x = randn(3, 64)
    w = randn(64, seed=1).requires_grad_()
    out = torch.empty_like(x)
    _C.rms_norm(x.numpy(), w.detach().numpy(), None, out.numpy(), 1e-5)
    torch.testing.assert_close(out, ops.rms_norm_reference(x, w.detach(), 1e-5), **close(x.dtype))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), out)


def test_errors():
    x, w = randn(2, 64), randn(64)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have the dtype of x \(float32\)"):
        ops.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] must be 64 \(the last dim of x\)"):
        ops.rms_norm(x, w[:32], 1e-5)
    with pytest.raises(
        ValueError, match=r"residual must have the shape of x \[2, 64\], got \[64\]"
    ):
        ops.rms_norm(x, w, 1e-5, randn(64))
    with pytest.raises(ValueError, match="silu_mul: the last dim of x .* must be even"):
        ops.silu_mul(randn(2, 7))
    q, k = qkv_views(1, 2, 4, 2, 64, torch.float32)
    cos = sin = torch.zeros(10, 64)
    with pytest.raises(ValueError, match=r"rotary: position 10 is outside the cos/sin table"):
        ops.rotary(q, k, cos, sin, torch.tensor([[3, 10]]))
    with pytest.raises(ValueError, match=r"rotary: cos.shape\[1\] must be 64 \(head_dim of q\)"):
        ops.rotary(q, k, cos[:, :32], sin, torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match=r"positions.shape\[1\] must be 2"):
        ops.rotary(q, k, cos, sin, torch.tensor([[3]]))
    caches = [torch.zeros(2, 2, 5, 64) for _ in range(2)]
    before = caches[0].clone()
    k = randn(1, 2, 2, 64)
    with pytest.raises(
        ValueError, match=r"kv_write: slot 5 is outside the positions its cache rows hold \[0, 5\)"
    ):
        ops.kv_write(*caches, k, k, torch.tensor([1]), torch.tensor([[4, 5]]))
    assert torch.equal(caches[0], before)  # checked before anything is written
    with pytest.raises(ValueError, match=r"kv_write: cache row 2 is outside \[0, 2\)"):
        ops.kv_write(*caches, k, k, torch.tensor([2]), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"slots must be int32 or int64, got float32"):
        ops.kv_write(*caches, k, k, torch.tensor([1]), torch.tensor([[0.0, 1.0]]))
