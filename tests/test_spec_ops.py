"""The speculative-decoding ops (tree attention over a wider mask, kv_commit, topk_expand, argmax)
against their pure-torch references in specinfer.ops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marks import gpu
from specinfer import ops

_C = pytest.importorskip("specinfer._C")


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


# --- kv_commit ---


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_kv_commit(trees, layers, dtype, index_dtype, seq_major, seed, device="cpu"):
    """After the commit, slots prefix .. prefix + len(path) - 1 hold the K/V that were at the
    path's slots; everything before the prefix and every other row is untouched."""
    gen = torch.Generator().manual_seed(seed)
    B, rows, heads, D = len(trees), len(trees) + 2, 3, 8
    seq = max(n + p for n, p in trees) + 2
    shape = (rows, heads, seq, D)
    caches = [
        torch.randn(rows, seq, heads, D, generator=gen).to(dtype).transpose(1, 2)
        if seq_major
        else torch.randn(*shape, generator=gen).to(dtype)
        for _ in range(2 * layers)
    ]
    caches = [c.to(device) for c in caches]
    cache_rows = torch.randperm(rows, generator=gen)[:B]
    paths = []
    for nodes, _ in trees:
        parents = random_parents(gen, nodes)
        paths.append(root_path(parents, int(torch.randint(nodes, (1,), generator=gen))))
    width = max(len(p) for p in paths) + int(torch.randint(3, (1,), generator=gen))
    accepted = torch.full((B, width), -1, dtype=index_dtype)
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path)
    prefix_lens = torch.tensor([p for _, p in trees], dtype=index_dtype)

    before = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    ops.kv_commit_reference(expected, cache_rows, prefix_lens, accepted)
    # Index tensors on the caches' device too: the wrapper copies them to the host.
    ops.kv_commit(caches, cache_rows.to(device), prefix_lens.to(device), accepted.to(device))
    for c, e, old in zip(caches, expected, before):
        assert torch.equal(c, e)
        untouched = torch.ones(rows, dtype=torch.bool)
        for b, path in enumerate(paths):
            row, n = int(cache_rows[b]), int(prefix_lens[b])
            untouched[row] = False
            assert torch.equal(c[row, :, :n], old[row, :, :n])
            assert torch.equal(c[row, :, n : n + len(path)], old[row, :, [n + i for i in path]])
        assert torch.equal(c[untouched.to(device)], old[untouched.to(device)])


kv_commit_cases = dict(
    trees=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=3),
    layers=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seq_major=st.booleans(),
    seed=st.integers(0, 2**31),
)


@settings(max_examples=60, deadline=None)
@given(**kv_commit_cases)
def test_kv_commit_moves_accepted_path(trees, layers, dtype, index_dtype, seq_major, seed):
    check_kv_commit(trees, layers, dtype, index_dtype, seq_major, seed)


@gpu
@settings(max_examples=60, deadline=None)
@given(**kv_commit_cases)
def test_kv_commit_moves_accepted_path_cuda(trees, layers, dtype, index_dtype, seq_major, seed):
    check_kv_commit(trees, layers, dtype, index_dtype, seq_major, seed, device="cuda")


def _commit_args():
    caches = [torch.zeros(3, 2, 10, 4) for _ in range(4)]
    return caches, torch.tensor([2, 0]), torch.tensor([3, 5]), torch.tensor([[0, 2, 4], [0, 1, -1]])


def _set(i, value):
    def change(args):
        args[i] = value

    return change


@pytest.mark.parametrize(
    "change,message",
    [
        (_set(0, []), r"caches is empty"),
        (
            _set(0, [torch.zeros(3, 2, 10, 4), torch.zeros(3, 2, 9, 4)]),
            r"caches\[1\] must have the shape of caches\[0\] \[3, 2, 10, 4\], got \[3, 2, 9, 4\]",
        ),
        (
            _set(0, [torch.zeros(3, 2, 10, 4), torch.zeros(3, 2, 10, 4).half()]),
            r"caches\[1\] must have the dtype of caches\[0\] \(float32\), got float16",
        ),
        (
            _set(0, [torch.zeros(3, 2, 10, 4).double()]),
            r"caches must be float32, bfloat16 or float16, got an unsupported dtype",
        ),
        (_set(0, [torch.zeros(3, 2, 10)]), r"caches\[0\] must have 4 dims"),
        (
            _set(0, [torch.zeros(3, 2, 4, 10).transpose(2, 3)]),
            r"caches\[0\] must be contiguous in its last dim",
        ),
        (_set(1, torch.tensor([2, 3])), r"cache_rows\[1\] = 3 is out of range \[0, 3\)"),
        (_set(1, torch.tensor([1, 1])), r"cache_rows holds row 1 twice"),
        (_set(1, torch.tensor([1.0, 2.0])), r"cache_rows must be int32 or int64, got float32"),
        (_set(2, torch.tensor([3])), r"prefix_lens.shape\[0\] must be 2"),
        (_set(2, torch.tensor([-1, 0])), r"prefix_lens\[0\] = -1 is negative"),
        (
            _set(2, torch.tensor([6, 5])),
            r"prefix_lens\[0\] \+ accepted\[0, 2\] = 6 \+ 4 must be < 10",
        ),
        (
            _set(3, torch.tensor([[0, 2, 2], [0, 1, -1]])),
            r"accepted\[0, 2\] = 2 must be greater than the previous node",
        ),
        (
            _set(3, torch.tensor([[0, -1, 4], [0, 1, -1]])),
            r"accepted\[0, 2\] = 4 follows -1 padding",
        ),
        (
            _set(3, torch.tensor([[0, 2, 4], [0, -2, -1]])),
            r"accepted\[1, 1\] = -2 \(padding must be -1\)",
        ),
        (
            _set(3, torch.tensor([0, 2, 4])),
            r"accepted must have 2 dims \[batch, max_accepted\], got 1",
        ),
    ],
)
def test_kv_commit_errors(change, message):
    args = list(_commit_args())
    change(args)
    with pytest.raises(ValueError, match=message):
        ops.kv_commit(*args)


def test_kv_commit_checks_everything_before_writing():
    caches, rows, prefix, _ = _commit_args()
    caches = [torch.randn_like(c) for c in caches]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=r"accepted\[1, 2\] = 2 must be greater"):
        ops.kv_commit(caches, rows, prefix, torch.tensor([[0, 2, 4], [0, 3, 2]]))
    assert all(torch.equal(c, old) for c, old in zip(caches, before))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_commit_cuda(dtype):
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(4, 3, 40, 64, generator=gen).to(dtype).cuda() for _ in range(6)]
    args = (torch.tensor([3, 0, 1]), torch.tensor([0, 17, 9]))
    accepted = torch.tensor([[0, 1, 5, 6, 9], [0, 3, 4, 12, 20], [0, 2, -1, -1, -1]])
    expected = [c.clone() for c in caches]
    ops.kv_commit_reference(expected, *args, accepted)
    ops.kv_commit(caches, *(t.cuda() for t in args), accepted.cuda())
    for c, e in zip(caches, expected):
        assert torch.equal(c, e)


# --- topk_expand ---


def assert_topk_matches_reference(logits, k, temperature):
    tokens, probs = ops.topk_expand(logits, k, temperature)
    ref_tokens, ref_probs = ops.topk_expand_reference(logits.cpu(), k, temperature)
    assert tokens.dtype == torch.int64 and probs.dtype == torch.float32
    assert tokens.device == probs.device == logits.device
    assert torch.equal(tokens.cpu(), ref_tokens)
    torch.testing.assert_close(probs.cpu(), ref_probs, atol=1e-7, rtol=1e-5)


def random_logits(rows, vocab, levels, seed):
    """`levels` draws logits from a few values only: many ties, broken by the lower token id."""
    gen = torch.Generator().manual_seed(seed)
    if levels is None:
        return torch.randn(rows, vocab, generator=gen) * 4
    return torch.randint(levels, (rows, vocab), generator=gen).float()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 3000),
    k_fraction=st.floats(0.0, 1.0),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    levels=st.sampled_from([None, 3]),
    seed=st.integers(0, 2**31),
)
def test_topk_expand_random(rows, vocab, k_fraction, temperature, dtype, levels, seed):
    logits = random_logits(rows, vocab, levels, seed)
    assert_topk_matches_reference(logits.to(dtype), round(k_fraction * vocab), temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_expand_vocabulary_rows(dtype):
    """SmolLM2's vocabulary, enough rows to run in parallel, a strided view, and k = V."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(8, 49152 + 5, generator=gen) * 3).to(dtype)[:, :49152]
    for k in (1, 3, 20):
        assert_topk_matches_reference(logits, k, 0.7)
    tokens, probs = ops.topk_expand(logits[:2], 49152, 1.0)
    assert torch.equal(tokens.sort(dim=-1).values, torch.arange(49152).expand(2, -1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert torch.all(probs[:, :-1] >= probs[:, 1:])


def test_topk_expand_ties_and_masked_tokens():
    logits = torch.tensor([[1.0, 3.0, 3.0, -math.inf, 3.0], [-math.inf, 0.0, -math.inf, 0.0, 5.0]])
    tokens, probs = ops.topk_expand(logits, 5, 0.0)
    assert tokens.tolist() == [[1, 2, 4, 0, 3], [4, 1, 3, 0, 2]]
    assert probs[0, 0] == probs[0, 1] == probs[0, 2] > probs[0, 3] > probs[0, 4] == 0
    assert probs[1, 1] == probs[1, 2] > probs[1, 3] == probs[1, 4] == 0
    assert_topk_matches_reference(logits, 5, 0.0)


@pytest.mark.parametrize(
    "logits,k,temperature,message",
    [
        (torch.zeros(2, 8), 9, 1.0, r"k = 9 must be in \[0, 8\] \(the vocabulary size"),
        (torch.zeros(2, 8), -1, 1.0, r"k = -1 must be in \[0, 8\]"),
        (torch.zeros(2, 8), 2, -0.5, r"temperature must be finite and >= 0, got -0.5"),
        (torch.zeros(2, 8), 2, math.inf, r"temperature must be finite and >= 0, got inf"),
    ],
)
def test_topk_expand_argument_errors(logits, k, temperature, message):
    for fn in (ops.topk_expand, ops.topk_expand_reference):
        with pytest.raises(ValueError, match=message):
            fn(logits, k, temperature)


@pytest.mark.parametrize(
    "logits,tokens,probs,message",
    [
        (torch.zeros(2, 8).half(), None, None, r"logits must be float32 or bfloat16, got float16"),
        (torch.zeros(8), None, None, r"logits must have 2 dims \[rows, vocab\], got 1"),
        (torch.zeros(8, 2).T, None, None, r"logits must be contiguous in its last dim"),
        (torch.zeros(2, 8), torch.zeros(2, 3, dtype=torch.int32), None, r"tokens must be int64"),
        (
            torch.zeros(2, 8),
            torch.zeros(2, 2, dtype=torch.int64),
            None,
            r"tokens.shape\[1\] must be 3 \(k\)",
        ),
        (
            torch.zeros(2, 8),
            None,
            torch.zeros(3, 3),
            r"probs.shape\[0\] must be 2 \(rows of logits\)",
        ),
        (torch.tensor([[0.0, math.nan]]), None, None, r"logits row 0 has no softmax"),
        (torch.tensor([[0.0, 1.0], [math.inf, 0.0]]), None, None, r"logits row 1 has no softmax"),
        (torch.full((1, 4), -math.inf), None, None, r"logits row 0 has no softmax"),
    ],
)
def test_topk_expand_kernel_errors(logits, tokens, probs, message):
    rows = logits.shape[0] if logits.dim() == 2 else 1
    tokens = torch.zeros(rows, 3, dtype=torch.int64) if tokens is None else tokens
    probs = torch.zeros(rows, 3) if probs is None else probs
    k = 3 if logits.shape[-1] >= 3 else 2
    if k == 2:
        tokens, probs = tokens[:, :2], probs[:, :2]
    with pytest.raises(ValueError, match=message):
        _C.topk_expand(logits, k, 1.0, tokens, probs)


# --- argmax (every greedy token a step keeps) ---


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 300),
    levels=st.sampled_from([None, 3]),
    specials=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 299),
                                st.sampled_from([math.nan, math.inf, -math.inf])), max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)  # fmt: skip
def test_argmax_is_torch_max_first_maximum(rows, vocab, levels, specials, dtype, seed):
    """The first maximum (ties are common with `levels`), a NaN counting as the maximum, +-inf
    as values: torch.max's indices, for vocabularies short of, at and past the kernel's lanes."""
    logits = random_logits(rows, vocab, levels, seed)
    for r, c, value in specials:
        logits[r % rows, c % vocab] = value
    logits = logits.to(dtype)
    assert torch.equal(ops.argmax(logits), logits.max(-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_vocabulary_rows(dtype):
    """SmolLM2's vocabulary in enough rows to run in parallel, as a strided view and as [B, T, V];
    the maximum in the last lane block, the tail and twice in a row; a row of -inf only."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 5, 49152 + 3, generator=gen) * 3).to(dtype)[..., :49152]
    logits[0, 0, 49151] = 100.0  # the last element (a tail past 49152 // 16 blocks is empty)
    logits[0, 1, 49140] = logits[0, 1, 49141] = 100.0
    logits[0, 2, 5] = logits[0, 2, 40000] = 100.0
    logits[1, 0] = -math.inf
    logits[1, 1, 17] = math.nan
    tokens = ops.argmax(logits)
    assert tokens.shape == (2, 5)
    assert torch.equal(tokens, logits.max(-1).indices)
    assert tokens[0, :3].tolist() == [49151, 49140, 5] and tokens[1, :2].tolist() == [0, 17]
    assert int(ops.argmax(logits[0, 3])) == int(logits[0, 3].max(-1).indices)


@pytest.mark.parametrize(
    "logits,out,message",
    [
        (torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), "logits"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), "out must be int64"),
        (torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64), "out"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), "no columns"),
        (torch.zeros(2, 5)[:, ::2], torch.zeros(2, dtype=torch.int64), "logits"),
    ],
)
def test_argmax_kernel_errors(logits, out, message):
    with pytest.raises(ValueError, match=message):
        _C.argmax(logits, out)


# --- topk_expand on cuda ---


@gpu
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    vocab=st.integers(1, 5000),
    k=st.integers(0, 64),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    levels=st.sampled_from([None, 3]),
    seed=st.integers(0, 2**31),
)
def test_topk_expand_cuda_random(rows, vocab, k, temperature, dtype, levels, seed):
    """k up to the cuda limit crosses every per-thread list size (4, 16, 64)."""
    logits = random_logits(rows, vocab, levels, seed).to(dtype)
    assert_topk_matches_reference(logits.cuda(), min(k, vocab), temperature)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [32000, 49152])
def test_topk_expand_cuda_vocabulary_rows(dtype, vocab):
    """Llama's and SmolLM2's vocabularies, a strided view, and every list size."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab + 5, generator=gen) * 3).to(dtype).cuda()[:, :vocab]
    for k in (1, 4, 5, 16, 17, 64):
        assert_topk_matches_reference(logits, k, 0.7)


@gpu
def test_topk_expand_cuda_ties_and_masked_tokens():
    logits = torch.tensor([[1.0, 3.0, 3.0, -math.inf, 3.0], [-math.inf, 0.0, -math.inf, 0.0, 5.0]])
    tokens, _ = ops.topk_expand(logits.cuda(), 5, 0.0)
    assert tokens.tolist() == [[1, 2, 4, 0, 3], [4, 1, 3, 0, 2]]
    assert_topk_matches_reference(logits.cuda(), 5, 0.0)


@gpu
def test_topk_expand_cuda_errors():
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(ValueError, match=r"k = 65 is above the cuda limit of 64"):
        ops.topk_expand(logits, 65, 1.0)
    with pytest.raises(ValueError, match=r"logits must be float32, bfloat16 or float16 on cuda"):
        ops.topk_expand(logits.double(), 3, 1.0)
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    probs = torch.zeros(2, 3, device="cuda")
    with pytest.raises(ValueError, match=r"tokens is on cpu:0 but logits is on cuda:0"):
        _C.topk_expand(logits, 3, 1.0, tokens, probs)
    bad = torch.zeros(3, 100, device="cuda")
    bad[1, 7] = math.nan
    bad[2] = -math.inf
    with pytest.raises(ValueError, match=r"logits row 1 has no softmax"):
        ops.topk_expand(bad, 3, 1.0)
    bad[1, 7] = math.inf
    with pytest.raises(ValueError, match=r"logits row 1 has no softmax"):
        ops.topk_expand(bad, 3, 1.0)
    bad[1, 7] = 0.0
    with pytest.raises(ValueError, match=r"logits row 2 has no softmax"):
        ops.topk_expand(bad, 3, 1.0)
