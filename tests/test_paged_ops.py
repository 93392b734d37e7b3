"""The KV ops with block tables (cache_rows [B, MB]: position p of request b at row
table[b, p // S], slot p % S) give exactly what they give on a row per request."""

import pytest
import torch

from marks import CUDA
from specinfer import ops

B, HQ, HKV, D, S, BLOCK = 3, 4, 2, 16, 64, 8
MB = S // BLOCK


def _table(gen: torch.Generator) -> torch.Tensor:
    """Each request's MB blocks, shuffled in a pool with spare blocks."""
    return torch.randperm(B * MB + 5, generator=gen)[: B * MB].view(B, MB)


def _pool(cache: torch.Tensor, table: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The rows of `cache` [B, H, S, D] cut into blocks of BLOCK slots at `table`'s places;
    the spare blocks hold noise."""
    pool = torch.randn(B * MB + 5, HKV, BLOCK, cache.shape[-1], generator=gen).to(cache.dtype)
    for b in range(B):
        for i in range(MB):
            pool[table[b, i]] = cache[b, :, i * BLOCK : (i + 1) * BLOCK]
    return pool


def _unpaged(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.cat([pool[r] for r in row.tolist()], dim=1) for row in table])


@pytest.mark.parametrize("device, dim", [("cpu", D), pytest.param("cuda", D, marks=CUDA.marks)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, M", [(1, 1), (5, 5), (4, 9)])
def test_tree_attention_on_block_tables_is_bit_identical(device, dim, dtype, T, M):
    gen = torch.Generator().manual_seed(T * 10 + M)
    k = torch.randn(B, HKV, S, dim, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S, dim, generator=gen).to(dtype)
    q = torch.randn(B, T, HQ, dim, generator=gen).to(dtype)
    prefix = torch.tensor([M - T, 17, S - T - 3])  # a block boundary inside, and near the end
    mask = torch.rand(B, T, M, generator=gen) < 0.6
    mask[:, :, M - T :] |= torch.eye(T, dtype=torch.bool)  # each token sees itself
    rows, table = torch.arange(B), _table(gen)
    kp, vp = _pool(k, table, gen), _pool(v, table, gen)
    k, v, q, kp, vp, prefix, mask, rows, table = (
        t.to(device) for t in (k, v, q, kp, vp, prefix, mask, rows, table)
    )
    expected = ops.tree_attention(q, k, v, rows, prefix, mask)
    assert torch.equal(ops.tree_attention(q, kp, vp, table, prefix, mask), expected)
    reference = ops.tree_attention_reference(q, kp, vp, table, prefix, mask)
    torch.testing.assert_close(reference, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_kv_write_and_commit_on_block_tables_match_rows(device):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(B, HKV, S, D, generator=gen)
    v = torch.randn(B, HKV, S, D, generator=gen)
    table = _table(gen)
    kp, vp = _pool(k, table, gen), _pool(v, table, gen)
    new_k, new_v = (
        torch.randn(B, 6, HKV, D, generator=gen),
        torch.randn(B, 6, HKV, D, generator=gen),
    )
    prefix = torch.tensor([0, 13, 40])  # the trees of 6 cross block boundaries
    slots = prefix[:, None] + torch.arange(6)
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 4, 5], [0, -1, -1, -1]])
    rows = torch.arange(B)
    k, v, kp, vp, new_k, new_v, table, prefix, slots, accepted, rows = (
        t.to(device) for t in (k, v, kp, vp, new_k, new_v, table, prefix, slots, accepted, rows)
    )
    for write in (ops.kv_write, ops.kv_write_reference):
        kc, vc, kq, vq = k.clone(), v.clone(), kp.clone(), vp.clone()
        write(kc, vc, new_k, new_v, rows, slots)
        write(kq, vq, new_k, new_v, table, slots)
        assert torch.equal(_unpaged(kq, table), kc) and torch.equal(_unpaged(vq, table), vc)
    for commit in (ops.kv_commit, ops.kv_commit_reference):
        kc, vc, kq, vq = k.clone(), v.clone(), kp.clone(), vp.clone()
        commit([kc, vc], rows, prefix, accepted)
        commit([kq, vq], table, prefix, accepted)
        assert torch.equal(_unpaged(kq, table), kc) and torch.equal(_unpaged(vq, table), vc)
    assert not torch.equal(kc, k)  # something moved


def test_block_tables_are_checked():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(B, HKV, S, D, generator=gen)
    table = _table(gen)
    kp = _pool(k, table, gen)
    q = torch.randn(B, 2, HQ, D)
    mask = torch.ones(B, 2, 2, dtype=torch.bool)
    bad = table.clone()
    bad[1, 2] = kp.shape[0]  # used by request 1 (positions 16..23)
    with pytest.raises(ValueError, match=r"cache_rows\[1\]\[2\] = .* out of range"):
        ops.tree_attention(q, kp, kp, bad, torch.tensor([3, 20, 5]), mask)
    with pytest.raises(ValueError, match="the positions its cache rows hold"):
        ops.tree_attention(q, kp, kp, table, torch.tensor([3, S - 1, 5]), mask)
    shared = table.clone()
    shared[2, 0] = shared[0, 0]  # two requests on one block
    with pytest.raises(ValueError, match="twice"):
        ops.kv_commit([kp], shared, torch.tensor([0, 0, 0]), torch.tensor([[0, 1]] * 3))
