"""The speculative-decoding ops (tree attention over a wider mask, kv_commit, topk_expand) against
their pure-torch references in specinfer.ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer import ops

_C = pytest.importorskip("specinfer._C")

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_parents(gen: torch.Generator, n: int) -> list[int]:
    """A random tree on n nodes, parents before children, node 0 the root."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """mask[i, j]: node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


# --- tree attention with a mask wider than the new tokens ---


def level_case(gen, prefixes, nodes, new, heads=(9, 3), head_dim=64, dtype=torch.float32):
    """A token tree of `nodes` nodes per request stored right after its prefix; the last `new`
    nodes are the queries. Returns the args with an [B, new, nodes] mask and the same call with
    all `nodes` as queries and an [B, nodes, nodes] mask."""
    hq, hkv = heads
    B, rows = len(prefixes), len(prefixes) + 2
    seq = max(prefixes) + nodes + 3
    k = torch.randn(rows, hkv, seq, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, hkv, seq, head_dim, generator=gen).to(dtype)
    q_all = torch.randn(B, nodes, hq, head_dim, generator=gen).to(dtype)
    cache_rows = torch.randperm(rows, generator=gen)[:B]
    masks = torch.stack([ancestor_mask(random_parents(gen, nodes)) for _ in range(B)])
    all_nodes = (q_all, k, v, cache_rows, torch.tensor(prefixes), masks)
    # The new level's prefix is everything before it: the committed tokens and the earlier nodes.
    level = (
        q_all[:, nodes - new :],
        k,
        v,
        cache_rows,
        torch.tensor(prefixes) + nodes - new,
        masks[:, nodes - new :],
    )
    return level, all_nodes


@settings(max_examples=40, deadline=None)
@given(
    prefixes=st.lists(st.integers(0, 90), min_size=1, max_size=3),
    nodes=st.integers(1, 40),
    new_fraction=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    head_dim=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**31),
)
def test_tree_attention_wide_mask(prefixes, nodes, new_fraction, dtype, head_dim, seed):
    """A level of new nodes attending under an [T, M] mask matches the reference, and both match
    the same nodes' rows of one call over the whole tree: level-by-level equals all-at-once."""
    new = max(1, round(nodes * new_fraction))
    level, all_nodes = level_case(
        torch.Generator().manual_seed(seed), prefixes, nodes, new, head_dim=head_dim, dtype=dtype
    )
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    got = ops.tree_attention(*level)
    torch.testing.assert_close(got.float(), ops.tree_attention_reference(*level).float(), **tol)
    whole = ops.tree_attention_reference(*all_nodes)[:, nodes - new :]
    torch.testing.assert_close(got.float(), whole.float(), **tol)


def test_tree_attention_wide_mask_reaches_cache_start():
    """s0 = 0: the mask starts at the first cache slot, so nothing is visible unconditionally."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 4, 32, generator=gen)
    k, v = torch.randn(2, 3, 2, 14, 32, generator=gen)
    mask = torch.zeros(2, 4, 12, dtype=torch.bool)
    mask[:, :, ::3] = True
    mask[1, 2] = False  # a row that sees nothing gets zeros
    args = (q, k, v, torch.tensor([2, 0]), torch.tensor([8, 8]), mask)
    got = ops.tree_attention(*args)
    torch.testing.assert_close(got, ops.tree_attention_reference(*args), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[1, 2]) == 0


@pytest.mark.parametrize(
    "mask_cols,prefix,message",
    [
        (2, [4, 5], r"tree_mask.shape\[2\] must be >= 3 \(tokens of q\), got 2"),
        (
            8,
            [4, 5],
            r"prefix_lens\[0\] \+ tokens - mask_cols = 4 \+ 3 - 8 must be >= 0",
        ),
    ],
)
def test_tree_attention_wide_mask_errors(mask_cols, prefix, message):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 4, 32, generator=gen)
    k = torch.randn(3, 2, 16, 32, generator=gen)
    mask = torch.ones(2, 3, mask_cols, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        ops.tree_attention(q, k, k, torch.tensor([0, 1]), torch.tensor(prefix), mask)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nodes,new", [(5, 1), (40, 7), (70, 33), (100, 64)])
def test_tree_attention_wide_mask_cuda(dtype, nodes, new):
    """Masks wider than 32 columns span several packed words."""
    level, all_nodes = level_case(torch.Generator().manual_seed(nodes), [0, 37, 300], nodes, new)
    level = tuple(t.to(dtype).cuda() if t.is_floating_point() else t.cuda() for t in level)
    got = ops.tree_attention(*level)
    expected = ops.tree_attention_reference(*level)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
