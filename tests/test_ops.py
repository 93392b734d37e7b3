"""The compiled ops against their pure-torch references (specinfer.ops)."""

from __future__ import annotations

import glob
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marks import gpu
from specinfer import ops

_C = pytest.importorskip("specinfer._C")


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self mask of a forest given each node's parent (-1 = a root)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def make_case(
    gen: torch.Generator,
    batch: int,
    tokens: int,
    prefixes: list[int],
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    mask_dtype: torch.dtype = torch.bool,
    layout: str = "contiguous",
    device: str = "cpu",
):
    hq, hkv = heads
    rows = batch + 2
    seq = max(prefixes) + tokens + 3
    shape = (rows, hkv, seq, head_dim)

    def cache() -> torch.Tensor:
        if layout == "seq_major":  # [rows, seq, kv_heads, D] viewed as [rows, kv_heads, seq, D]
            t = torch.randn(rows, seq, hkv, head_dim, generator=gen).transpose(1, 2)
        elif layout == "padded":  # head_dim sliced out of a wider buffer
            t = torch.randn(rows, hkv, seq, head_dim + 8, generator=gen)[..., :head_dim]
        else:
            t = torch.randn(*shape, generator=gen)
        return t.to(dtype)

    k_cache, v_cache = cache(), cache()
    assert k_cache.shape == shape
    q = torch.randn(batch, tokens, hq, head_dim, generator=gen).to(dtype)
    cache_rows = torch.randperm(rows, generator=gen)[:batch].to(index_dtype)
    prefix_lens = torch.tensor(prefixes, dtype=index_dtype)
    masks = []
    for _ in range(batch):
        kind = torch.randint(3, (1,), generator=gen).item()
        used = torch.randint(1, tokens + 1, (1,), generator=gen).item()
        if kind == 0:  # a causal chain
            parents = list(range(-1, used - 1))
        else:  # a random tree (or forest), parents before children
            parents = [-1] + [
                torch.randint(-1 if kind == 2 else 0, i, (1,), generator=gen).item()
                for i in range(1, used)
            ]
        m = torch.zeros(tokens, tokens, dtype=torch.bool)
        m[:used, :used] = tree_mask_from_parents(parents)  # rows past `used` are padding
        masks.append(m)
    tree_mask = torch.stack(masks).to(mask_dtype)
    args = (q, k_cache, v_cache, cache_rows, prefix_lens, tree_mask)
    return tuple(a.to(device) for a in args)


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-5, rtol=1e-5)}.get(dtype, dict(atol=2e-2, rtol=2e-2))


def assert_matches_reference(args, scale=None):
    expected = ops.tree_attention_reference(*args, scale=scale)
    got = ops.tree_attention(*args, scale=scale)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(args[0].dtype))


def _binary_has_cuda_code() -> bool:
    """Whether the extension's shared object holds CUDA device code: nvcc-compiled objects put
    their kernels in an ELF section named .nv_fatbin (read from the file, not asked of _C)."""
    return b".nv_fatbin" in Path(_C.__file__).read_bytes()


def test_backends_match_the_compiled_extension():
    with_cuda = _binary_has_cuda_code()
    assert _C.backends() == (["cpu", "cuda"] if with_cuda else ["cpu"])
    expect = os.environ.get("SPECINFER_EXPECT_CUDA")
    if expect == "1":  # .ci/run sets it where nvcc exists: the build must not have lost CUDA
        assert with_cuda, "SPECINFER_EXPECT_CUDA=1 but the extension was built without CUDA"
    elif expect == "0":
        assert not with_cuda, "SPECINFER_EXPECT_CUDA=0 but the extension was built with CUDA"


def _visible_nvidia_devices() -> int:
    """NVIDIA device nodes (/dev/nvidia0, ...): without any, no CUDA runtime can see a GPU."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def test_cuda_device_count_is_what_the_runtime_sees():
    count = _C.cuda_device_count()
    assert isinstance(count, int)
    if "cuda" not in _C.backends() or _visible_nvidia_devices() == 0:
        assert count == 0
    if torch.version.cuda is not None:  # a CUDA build of torch asks the same runtime
        assert count == torch.cuda.device_count()


@gpu
def test_cuda_device_count_follows_cuda_visible_devices():
    assert "cuda" in _C.backends()
    assert _C.cuda_device_count() == torch.cuda.device_count() >= 1
    hidden = subprocess.run(
        [sys.executable, "-c", "from specinfer import _C; print(_C.cuda_device_count())"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    assert hidden.stdout.strip() == "0"


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4),
    tokens=st.integers(1, 20),
    prefix=st.lists(st.integers(0, 300), min_size=4, max_size=4),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 2)]),
    head_dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    mask_dtype=st.sampled_from([torch.bool, torch.uint8]),
    layout=st.sampled_from(["contiguous", "seq_major", "padded"]),
    seed=st.integers(0, 2**31),
)
def test_tree_attention_cpu_random(
    batch, tokens, prefix, heads, head_dim, dtype, index_dtype, mask_dtype, layout, seed
):
    gen = torch.Generator().manual_seed(seed)
    args = make_case(
        gen, batch, tokens, prefix[:batch], heads, head_dim, dtype, index_dtype, mask_dtype, layout
    )
    assert_matches_reference(args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,prefix", [(1, 0), (1, 2048), (64, 0), (200, 37), (33, 0)])
def test_tree_attention_cpu_shapes(dtype, tokens, prefix):
    """Decode, long prefixes, and prefill blocks long enough to be split into query chunks."""
    gen = torch.Generator().manual_seed(tokens + prefix)
    args = make_case(gen, 1, tokens, [prefix], (9, 3), 64, dtype)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None]
    assert_matches_reference((*args[:5], causal))
    assert_matches_reference(args, scale=0.3)


def test_tree_attention_padding_row_without_prefix_is_zero():
    gen = torch.Generator().manual_seed(0)
    q, k, v, rows, prefix, mask = make_case(gen, 2, 5, [0, 10], (4, 4), 32)
    mask[:, 3:] = False
    out = ops.tree_attention(q, k, v, rows, prefix, mask)
    assert torch.count_nonzero(out[0, 3:]) == 0
    assert torch.count_nonzero(out[1, 3:]) > 0  # request 1 still sees its prefix
    assert_matches_reference((q, k, v, rows, prefix, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_tree_attention_row_does_not_depend_on_the_block(dtype, head_dim):
    """A tree node's output equals, bit for bit, that of the node run alone after its ancestors
    (how incremental decoding would compute it): what makes speculation exactly lossless."""
    gen = torch.Generator().manual_seed(head_dim)
    # Long prefixes make even one token's call parallel, its query rows split between threads.
    for tokens, prefixes in itertools.product((1, 5, 31, 40), ([37, 70], [37, 400])):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, tokens)]
        q, k, v, rows, prefix, _ = make_case(gen, 2, tokens, prefixes, (6, 2), head_dim, dtype)
        mask = tree_mask_from_parents(parents).expand(2, tokens, tokens).contiguous()
        block = ops.tree_attention(q, k, v, rows, prefix, mask)
        for i in range(tokens):  # node i alone: its slot is prefix + i, its mask the i + 1 slots
            alone = ops.tree_attention(q[:, i : i + 1].contiguous(), k, v, rows, prefix + i,
                                       mask[:, i : i + 1, : i + 1].contiguous())  # fmt: skip
            assert torch.equal(alone[:, 0], block[:, i]), f"{tokens} tokens, node {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_tree_node_equals_its_path_decoded_after_commit(dtype, head_dim):
    """A tree node's output equals, bit for bit, that of the same query decoded alone once its
    ancestors are committed to consecutive slots (what incremental decoding computes). In the tree
    those keys sit at gapped slots, so nothing may depend on where key tiles start."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 12
    for prefix_len in range(20, 44):  # the tree's slots straddle a key tile boundary
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, tokens)]
        q, k, v, rows, prefix, _ = make_case(gen, 1, tokens, [prefix_len], (6, 2), head_dim, dtype)
        mask = tree_mask_from_parents(parents)[None]
        block = ops.tree_attention(q, k, v, rows, prefix, mask)
        for i in range(tokens):
            path = mask[0, i].nonzero()[:, 0].tolist()  # root ... node i, in slot order
            kc, vc = k.clone(), v.clone()
            for depth, node in enumerate(path):  # the commit: path node -> slot prefix + depth
                kc[rows, :, prefix_len + depth] = k[rows, :, prefix_len + node]
                vc[rows, :, prefix_len + depth] = v[rows, :, prefix_len + node]
            one = torch.ones(1, 1, 1, dtype=torch.bool)
            alone = ops.tree_attention(q[:, i : i + 1].contiguous(), kc, vc, rows,
                                       prefix + len(path) - 1, one)  # fmt: skip
            assert torch.equal(alone[:, 0], block[:, i]), f"prefix {prefix_len}, node {i}"


def test_tree_attention_requires_grad_and_numpy():
    gen = torch.Generator().manual_seed(1)
    q, k, v, rows, prefix, mask = make_case(gen, 2, 4, [3, 7], (8, 2), 64)
    out = ops.tree_attention(q.requires_grad_(), k, v, rows, prefix, mask)
    torch.testing.assert_close(
        out, ops.tree_attention_reference(q.detach(), k, v, rows, prefix, mask)
    )
    # Any __dlpack__ producer works, not only torch.
    got = torch.empty_like(out)
    _C.tree_attention(
        q.detach().numpy(),
        k.numpy(),
        v.numpy(),
        rows.numpy(),
        prefix.numpy(),
        mask.numpy(),
        got.numpy(),
        1 / math.sqrt(64),
    )
    torch.testing.assert_close(got, out)


def _bad_args():
    gen = torch.Generator().manual_seed(2)
    return list(make_case(gen, 2, 3, [4, 5], (9, 3), 64))


def _narrow_kv_head_dim(args):
    args[1], args[2] = args[1][..., :32], args[2][..., :32]


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda a: a.__setitem__(1, a[1][0]),
            r"k_cache must have 4 dims \[rows, kv_heads, seq, head_dim\], got 3",
        ),
        (
            lambda a: a.__setitem__(0, a[0][..., :5, :]),
            r"q_heads \(5\) must be a multiple of kv_heads \(3\)",
        ),
        (
            lambda a: a.__setitem__(2, a[2].double()),
            r"v_cache must have the dtype of q \(float32\), got an unsupported dtype",
        ),
        (
            lambda a: a.__setitem__(3, a[3].float()),
            r"cache_rows must be int32 or int64, got float32",
        ),
        (
            lambda a: a.__setitem__(3, torch.tensor([0, 4])),
            r"cache_rows\[1\] = 4 is out of range \[0, 4\)",
        ),
        (
            lambda a: a.__setitem__(3, torch.tensor([-1, 0])),
            r"cache_rows\[0\] = -1 is out of range",
        ),
        (
            lambda a: a.__setitem__(4, torch.tensor([4, 9])),
            r"prefix_lens\[1\] \+ tokens = 9 \+ 3 must be in \[0, 11\]",
        ),
        (lambda a: a.__setitem__(4, torch.tensor([4])), r"prefix_lens.shape\[0\] must be 2"),
        (lambda a: a.__setitem__(5, a[5][:, :2]), r"tree_mask.shape\[1\] must be 3"),
        (lambda a: a.__setitem__(5, a[5].float()), r"tree_mask must be bool or uint8, got float32"),
        (
            lambda a: a.__setitem__(2, a[2][..., :32]),
            r"v_cache must have the shape of k_cache \[4, 3, 11, 64\], got \[4, 3, 11, 32\]",
        ),
        (_narrow_kv_head_dim, r"k_cache.shape\[3\] must be 64 \(head_dim of q\), got 32"),
        (
            lambda a: a.__setitem__(0, a[0].transpose(1, 3).contiguous().transpose(1, 3)),
            r"q must be contiguous in its last dim",
        ),
    ],
)
def test_tree_attention_errors(change, message):
    args = _bad_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        ops.tree_attention(*args)


def test_tree_attention_error_out_and_dtype():
    q, k, v, rows, prefix, mask = _bad_args()
    with pytest.raises(
        ValueError, match=r"q must be a tensor with __dlpack__ \(e.g. torch.Tensor\), got list"
    ):
        _C.tree_attention([1.0], k, v, rows, prefix, mask, q, 1.0)
    with pytest.raises(
        ValueError, match=r"out must have the shape of q \[2, 3, 9, 64\], got \[2, 3, 9, 32\]"
    ):
        _C.tree_attention(q, k, v, rows, prefix, mask, torch.empty(2, 3, 9, 32), 1.0)
    h = [t.half() if t.is_floating_point() else t for t in (q, k, v, rows, prefix, mask)]
    with pytest.raises(ValueError, match="float16 is not supported on cpu"):
        ops.tree_attention(*h)


@gpu
def test_tree_attention_mixed_devices():
    q, k, v, rows, prefix, mask = _bad_args()
    with pytest.raises(ValueError, match="k_cache is on cpu:0 but q is on cuda:0"):
        ops.tree_attention(q.cuda(), k, v.cuda(), rows.cuda(), prefix.cuda(), mask.cuda())


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 256])  # padded to 32, 64, 128, 128, 256
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (32, 8)])
@pytest.mark.parametrize("tokens", [1, 7, 20, 70])
@pytest.mark.parametrize("layout", ["contiguous", "seq_major"])
def test_tree_attention_cuda(dtype, head_dim, heads, tokens, layout):
    gen = torch.Generator().manual_seed(tokens * head_dim)
    for batch, prefixes in [(1, [0]), (3, [5, 300, 129]), (4, [0, 1, 2047, 64])]:
        args = make_case(
            gen, batch, tokens, prefixes, heads, head_dim, dtype, layout=layout, device="cuda"
        )
        expected = ops.tree_attention_reference(*args)
        got = ops.tree_attention(*args, check_indices=False)  # as the models call it
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), expected.float(), **tol)


@gpu
@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(1, 5),
    tokens=st.integers(1, 130),
    prefix=st.lists(st.integers(0, 700), min_size=5, max_size=5),
    heads=st.sampled_from([(9, 3), (32, 32), (32, 8), (4, 4)]),
    head_dim=st.sampled_from([8, 40, 64, 96, 128, 256]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    mask_dtype=st.sampled_from([torch.bool, torch.uint8]),
    layout=st.sampled_from(["contiguous", "seq_major", "padded"]),
    seed=st.integers(0, 2**31),
    check_indices=st.booleans(),
)
def test_tree_attention_cuda_random(
    batch,
    tokens,
    prefix,
    heads,
    head_dim,
    dtype,
    index_dtype,
    mask_dtype,
    layout,
    seed,
    check_indices,
):
    """Trees past 64 nodes (several packed mask words and query-row blocks), a prefix length per
    request, GQA, every dtype, index and mask dtype and cache layout."""
    gen = torch.Generator().manual_seed(seed)
    args = make_case(
        gen,
        batch,
        tokens,
        prefix[:batch],
        heads,
        head_dim,
        dtype,
        index_dtype,
        mask_dtype,
        layout,
        device="cuda",
    )
    expected = ops.tree_attention_reference(*args)
    got = ops.tree_attention(*args, check_indices=check_indices)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@gpu
def test_tree_attention_cuda_unchecked_indices_never_read_outside():
    """Unchecked, a key at a row past the cache or a position past its row is skipped: request 1
    (row 9 of 4) sees nothing and gets zeros; request 0 keeps only the slots its row holds."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, rows, prefix, mask = make_case(gen, 2, 3, [4, 5], (9, 3), 64, device="cuda")
    got = ops.tree_attention(
        q, k, v, torch.tensor([0, 9], device="cuda"), prefix, mask, check_indices=False
    )
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    seq = k.shape[2]
    prefix = torch.tensor([seq - 1, 4], device="cuda")  # request 0's tree runs past its row
    got = ops.tree_attention(q, k, v, rows, prefix, mask, check_indices=False)
    # Request 0's first node sits at slot seq - 1, the last its row holds; the other two slots do
    # not exist. The same attention, stated with the tree at slots seq - 3 .. seq - 1 and its
    # first two columns seeing everything: slot seq - 1 seen as mask column 0 says.
    same = torch.ones(1, 3, 3, dtype=torch.bool, device="cuda")
    same[0, :, 2] = mask[0, :, 0]
    expected = ops.tree_attention_reference(
        q[:1], k, v, rows[:1], torch.tensor([seq - 3], device="cuda"), same
    )
    torch.testing.assert_close(got[:1], expected)


@gpu
def test_tree_attention_cuda_errors():
    q, k, v, rows, prefix, mask = (t.cuda() for t in _bad_args())
    with pytest.raises(ValueError, match=r"cache_rows\[1\] = 9 is out of range"):
        ops.tree_attention(q, k, v, torch.tensor([0, 9], device="cuda"), prefix, mask)
    wide = [t.repeat(1, 1, 1, 5) for t in (q, k, v)]  # head_dim 320
    with pytest.raises(ValueError, match=r"head_dim 320 is not supported on cuda \(at most 256\)"):
        ops.tree_attention(*wide, rows, prefix, mask)


# --- linear ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 64])
# (1100, 64): 35 blocks of 32 weight rows on AMX, written 16 blocks at a time: several groups,
# the last one short, ending in a partial block.
@pytest.mark.parametrize(
    "n,k", [(576, 576), (192, 576), (7, 33), (1, 1), (13, 100), (37, 1536), (1100, 64)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(dtype, rows, n, k, with_bias):
    assert_linear_matches_torch(dtype, rows, n, k, with_bias, lambda w: w)


def assert_linear_matches_torch(dtype, rows, n, k, with_bias, layout) -> None:
    """_C.linear with the weight as `layout` gives it against float64 torch."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = torch.empty(rows, n, dtype=dtype)
    _C.linear(x, layout(w), bias, out)
    expected = torch.nn.functional.linear(
        x.double(), w.double(), None if bias is None else bias.double()
    )
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (40, 96): three k tiles on AMX, so past 16 rows the last is taken alone after a pair.
@pytest.mark.parametrize("n,k", [(96, 576), (200, 77), (37, 1536), (9, 5), (1100, 64), (40, 96)])
def test_linear_row_does_not_depend_on_the_other_rows(dtype, n, k):
    """Each output row is summed in the same order whatever the row count, so a tree's (or a
    batch's) rows equal, bit for bit, the rows computed one at a time."""
    assert_rows_independent(
        dtype, n, k, lambda w: w, (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 33, 64)
    )


def assert_rows_independent(dtype, n, k, layout, row_counts) -> None:
    """Each row of an _C.linear call over `row_counts` rows equals, bit for bit, that row alone."""
    gen = torch.Generator().manual_seed(n)
    w = layout(torch.randn(n, k, generator=gen).to(dtype))
    bias = torch.randn(n, generator=gen).to(dtype)
    for rows in row_counts:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        out = torch.empty(rows, n, dtype=dtype)
        _C.linear(x, w, bias, out)
        for i in range(rows):
            one = torch.empty(1, n, dtype=dtype)
            _C.linear(x[i : i + 1], w, bias, one)
            assert torch.equal(one[0], out[i]), f"{rows} rows, row {i}"


def test_linear_strided_rows_and_ops_wrapper():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 2, 100, generator=gen).bfloat16()
    x = base[:, 0]  # rows 200 elements apart
    w = torch.randn(40, 128, generator=gen).bfloat16()[:, :100]
    out = torch.empty(6, 40, dtype=torch.bfloat16)
    _C.linear(x, w, None, out)
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    x3 = torch.randn(2, 3, 100, generator=gen).bfloat16()
    got = ops.linear(x3, w)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.float(), x3.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    # Autograd still works: training goes to torch.
    wg = w.float().requires_grad_()
    ops.linear(x3.float(), wg).sum().backward()
    assert wg.grad is not None


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_linear_strided_operands_equal_contiguous(rows):
    """Rows of x, w and out apart by more than their length (K = 64 takes the AMX path where the
    CPU has it): the same bits as contiguous copies."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 64, generator=gen).bfloat16()[:, 1]
    w = torch.randn(70, 96, generator=gen).bfloat16()[:, 16:80]
    bias = torch.randn(70, 2, generator=gen).bfloat16()[:, 0]
    out = torch.empty(rows, 90, dtype=torch.bfloat16)[:, 10:80]
    _C.linear(x, w, bias, out)
    dense = torch.empty(rows, 70, dtype=torch.bfloat16)
    _C.linear(x.contiguous(), w.contiguous(), bias.contiguous(), dense)
    assert torch.equal(out, dense)
    expected = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            (torch.zeros(2, 8), torch.zeros(3, 9), None, torch.zeros(2, 3)),
            r"weight.shape\[1\] must be 8 \(in_features of x\), got 9",
        ),
        (
            (torch.zeros(2, 8), torch.zeros(3, 8), None, torch.zeros(2, 4)),
            r"out.shape\[1\] must be 3",
        ),
        (
            (torch.zeros(2, 8), torch.zeros(3, 8).bfloat16(), None, torch.zeros(2, 3)),
            r"weight must have the dtype of x \(float32\), got bfloat16",
        ),
        (
            (torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(4), torch.zeros(2, 3)),
            r"bias.shape\[0\] must be 3",
        ),
        (
            (torch.zeros(8), torch.zeros(3, 8), None, torch.zeros(2, 3)),
            r"x must have 2 dims \[rows, in_features\], got 1",
        ),
        (
            (torch.zeros(2, 8).half(), torch.zeros(3, 8).half(), None, torch.zeros(2, 3).half()),
            r"x must be float32 or bfloat16, got float16",
        ),
        (
            (torch.zeros(2, 8), torch.zeros(8, 3).T, None, torch.zeros(2, 3)),
            r"weight must be contiguous in its last dim",
        ),
    ],
)
def test_linear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        _C.linear(*args)


def test_ops_linear_dispatch(monkeypatch):
    """bf16 (in blocks of 64 rows) and, when opted in, fp32 (in blocks of 32) take the kernel,
    whatever the row count: a row's result must not depend on the rows beside it."""
    monkeypatch.setattr(ops, "FAST_LINEAR_FP32", True)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(24, 40, generator=gen)
    calls = []
    monkeypatch.setattr(
        ops,
        "_C",
        type(
            "Spy",
            (),
            {
                "linear": lambda *a: calls.append(a) or _C.linear(*a),
                "is_recording": _C.is_recording,
            },
        ),
    )
    for dtype, rows, expect in [
        (torch.bfloat16, 64, 1),
        (torch.bfloat16, 130, 3),
        (torch.float32, 32, 1),
        (torch.float32, 33, 2),
    ]:
        calls.clear()
        x = torch.randn(rows, 40, generator=gen).to(dtype)
        got = ops.linear(x, w.to(dtype))
        torch.testing.assert_close(
            got.float(), x.float() @ w.to(dtype).float().T, atol=3e-2, rtol=2e-2
        )
        assert len(calls) == expect, (dtype, rows)
    monkeypatch.setattr(ops, "FAST_LINEAR_FP32", False)
    calls.clear()
    ops.linear(torch.randn(1, 40), w)
    assert not calls


def packed(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w.shape[0] // 16, w.shape[1], 16, dtype=w.dtype)
    _C.pack_linear_panels(w, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 64])
# (80, 33): 5 panels, so at one row (4 panels a tile) the last is taken alone.
@pytest.mark.parametrize("n,k", [(16, 1), (576, 576), (48, 1536), (80, 33), (1152, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_torch(dtype, rows, n, k, with_bias):
    assert_linear_matches_torch(dtype, rows, n, k, with_bias, packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(96, 576), (208, 77), (48, 1536), (16, 5), (80, 40)])
def test_packed_linear_row_does_not_depend_on_the_other_rows(dtype, n, k):
    """Every output of the panel kernel is one FMA chain along K, whichever tile computes it."""
    assert_rows_independent(dtype, n, k, packed, (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 33))


PACKED_PROBE = """
import sys, torch
from specinfer import _C
gen = torch.Generator().manual_seed(0)
outs = []
for dtype in (torch.float32, torch.bfloat16):
    w = torch.randn(4096 + 64, 77, generator=gen).to(dtype)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype)
    p = torch.empty(w.shape[0] // 16, 77, 16, dtype=dtype)
    _C.pack_linear_panels(w, p)
    x = torch.randn(9, 77, generator=gen).to(dtype)
    for rows in (1, 2, 3, 7, 9):
        out = torch.empty(rows, w.shape[0], dtype=dtype)
        _C.linear(x[:rows], p, bias, out)
        outs.append(out)
torch.save(outs, sys.argv[1])
"""


def test_packed_linear_sums_as_the_portable_kernel(tmp_path):
    """The summation order, pinned: the vector kernel's bits are the portable one's (std::fma
    along K, output by output); both families run on every x86 CI machine."""
    if _C.cpu_isa() == "portable":
        pytest.skip("this CPU runs the portable kernel only")
    runs = {}
    for isa in ("native", "portable"):
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", PACKED_PROBE, str(path)], check=True, timeout=120,
                       env={**os.environ, "SPECINFER_CPU_ISA": isa})  # fmt: skip
        runs[isa] = torch.load(path)
    for native, portable in zip(runs["native"], runs["portable"], strict=True):
        assert torch.equal(native, portable)


def test_pack_linear_only_where_the_panel_kernel_is_preferred(monkeypatch):
    w = torch.randn(32, 24).bfloat16()
    monkeypatch.setattr(ops, "panels_preferred", lambda dtype: True)
    p = ops.pack_linear(w)
    assert p.shape == (2, 24, 16) and p.dtype == torch.bfloat16
    # Panel 1 holds output features 16-31 (in the kernel's slot order) at every column.
    assert sorted(p[1, 3].tolist()) == sorted(w[16:32, 3].tolist())
    assert ops.pack_linear(torch.randn(40, 24).bfloat16()) is None  # 40 % 16 != 0
    monkeypatch.setattr(ops, "panels_preferred", lambda dtype: False)
    assert ops.pack_linear(w) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_rows_of_a_packed_weight_are_its_rows(dtype):
    w = torch.randn(48, 24).to(dtype)
    ids = torch.tensor([[0, 5, 17], [47, 31, 16]])
    assert torch.equal(ops.weight_rows(packed(w), ids), w[ids])
    assert torch.equal(ops.weight_rows(w, ids), w[ids])


def test_ops_linear_takes_a_packed_weight():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(2, 5, 40, generator=gen).bfloat16()
    got = ops.linear(x, packed(w), bias)
    assert got.shape == (2, 5, 48)
    expected = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="packed weight .* runs only in the compiled CPU kernel"):
        ops.linear(x.float().requires_grad_(), packed(w.float()).requires_grad_())


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: _C.pack_linear_panels(torch.zeros(24, 8), torch.zeros(1, 8, 16)),
         "out_features must be a multiple of 16"),
        (lambda: _C.pack_linear_panels(torch.zeros(32, 8), torch.zeros(2, 9, 16)),
         r"out.shape\[1\] must be 8"),
        (lambda: _C.pack_linear_panels(torch.zeros(32, 8), torch.zeros(2, 8, 16).bfloat16()),
         "out must have the dtype of weight"),
        (lambda: _C.linear(torch.zeros(2, 9), torch.zeros(2, 8, 16), None, torch.zeros(2, 32)),
         "x has 9 in_features, the packed weight 8"),
        (lambda: _C.linear(torch.zeros(2, 8), torch.zeros(2, 8, 16), None, torch.zeros(2, 30)),
         "out has 30 columns, the packed weight 32 out_features"),
        (lambda: _C.linear(torch.zeros(2, 8), torch.zeros(2, 8, 15), None, torch.zeros(2, 30)),
         r"weight.shape\[2\] must be 16"),
        (lambda: _C.linear(torch.zeros(2, 8), torch.zeros(2, 16, 16)[:, :8], None,
                           torch.zeros(2, 32)),
         "weight must be contiguous"),
    ],
)  # fmt: skip
def test_packed_linear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def int8_case(gen, rows, n, k, dtype, with_bias):
    w = torch.randn(n, k, generator=gen)
    w[0] = 0.0  # an all-zero row: its scale must not divide by zero
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return x.to(dtype), *ops.quantize_int8(w), bias, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (4, 576), (17, 1536), (33, 128), (3, 40),
                                          (5, 130), (1, 7), (20, 192)])  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int8_equals_its_reference(dtype, rows, k, with_bias):
    """Integer dot products are exact, so the kernel (AMX tiles when K is a multiple of 64, else
    VNNI or vectorised loops) gives the reference's bits, and stays close to the float product."""
    gen = torch.Generator().manual_seed(rows * k)
    x, codes, scale, bias, w = int8_case(gen, rows, 301, k, dtype, with_bias)
    assert codes.dtype == torch.uint8 and int(codes.min()) >= 1 and scale[0] == 1
    got = ops.linear_int8(x, codes, scale, bias)
    expected = ops.linear_int8_reference(x, codes, scale, bias)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    exact = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    err = (got.float() - exact).abs().max() / exact.abs().max()
    assert err < 0.03, f"int8 error {err:.4f} of the largest output"


def test_linear_int8_row_does_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(3)
    x, codes, scale, bias, _ = int8_case(gen, 20, 64, 576, torch.bfloat16, True)
    block = ops.linear_int8(x, codes, scale, bias)
    for i in (0, 7, 19):
        assert torch.equal(ops.linear_int8(x[i : i + 1], codes, scale, bias)[0], block[i])


def test_quantize_int8_round_trip():
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(1))
    codes, scale = ops.quantize_int8(w)
    back = (codes.float() - 128) * scale[:, None]
    assert (back - w).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"codes": torch.zeros(3, 8, dtype=torch.int8)}, r"weight must be uint8 codes"),
        ({"scale": torch.ones(3, dtype=torch.float64)}, r"scale must be float32, got"),
        ({"scale": torch.ones(4)}, r"scale.shape\[0\] must be 3"),
        ({"codes": torch.zeros(3, 9, dtype=torch.uint8)}, r"weight.shape\[1\] must be 8"),
        ({"out": torch.zeros(2, 3).bfloat16()}, r"out must have the dtype of x"),
    ],
)
def test_linear_int8_errors(change, message):
    args = {"x": torch.zeros(2, 8), "codes": torch.zeros(3, 8, dtype=torch.uint8),
            "scale": torch.ones(3), "bias": None, "out": torch.zeros(2, 3), **change}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        _C.linear_int8(*args.values())


ISA_RANK = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 2, "amx_bf16": 3}


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_cpu_kernel_family_passes_the_op_tests(isa):
    """The CPU ops pick their kernels by what the CPU has, so a machine runs one family only;
    SPECINFER_CPU_ISA caps it, and the op tests run again under each family below the native one
    (each must match the references and compute a row the same whatever rows share a call)."""
    native = _C.cpu_isa()
    if ISA_RANK[native] <= ISA_RANK[isa]:
        pytest.skip(f"this CPU's best kernels are {native}: covered by the tests themselves")
    env = {**os.environ, "SPECINFER_CPU_ISA": isa}
    probe = [sys.executable, "-c", "from specinfer import _C; print(_C.cpu_isa())"]
    capped = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120,
                            check=True).stdout.strip()  # fmt: skip
    assert ISA_RANK[capped] == ISA_RANK[isa], capped
    tests = [str(Path(__file__).parent / name)
             for name in ("test_ops.py", "test_fused_ops.py", "test_spec_ops.py")]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests,
         "-k", "not every_cpu_kernel_family"],  # fmt: skip
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_an_unknown_cpu_isa_is_a_clear_error():
    env = {**os.environ, "SPECINFER_CPU_ISA": "avx1024"}
    run = subprocess.run([sys.executable, "-c", "import specinfer.ops"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0 and "SPECINFER_CPU_ISA='avx1024'" in run.stderr
