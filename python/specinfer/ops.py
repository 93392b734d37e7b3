"""Thin wrappers over the compiled core (`specinfer._C`), each with a pure-torch reference.

The references define the semantics; tests compare the kernels against them.
"""

from __future__ import annotations

import math
import os

import torch

try:
    from specinfer import _C
except ImportError:  # pragma: no cover - only when the extension was not built
    _C = None

# SPECINFER_CPU_ISA=avx512 (no AMX), =avx2 or =portable runs the CPU kernels of that family even
# where the CPU has better ones (to test or measure them); "native" or unset, the best the CPU
# has. `_C.cpu_isa()` says which family runs.
CPU_ISAS = ("native", "avx512", "avx2", "portable")
if os.environ.get("SPECINFER_CPU_ISA", "native") not in CPU_ISAS:
    raise ValueError(
        f"SPECINFER_CPU_ISA={os.environ['SPECINFER_CPU_ISA']!r}: expected one of {CPU_ISAS}"
    )


class RecordingRefused(RuntimeError):
    """A torch op was about to run while an OpGraph records (it would not be replayed)."""


def refuse_while_recording(op: str) -> None:
    """Called by every torch fallback below: a graph recording must hold only compiled ops."""
    if _C is not None and _C.is_recording():
        raise RecordingRefused(f"{op} would run in torch, which an OpGraph cannot record")


def kv_locations(cache_rows: torch.Tensor, positions: torch.Tensor, seq_len: int):
    """Where positions [B, L] of each request live in a cache [N, Hkv, S, D]: (rows, slots),
    each [B, L]. cache_rows is [B] (request b owns row cache_rows[b]: position p at slot p) or
    a block table [B, MB] (position p at row cache_rows[b, p // S], slot p % S: the rows are
    blocks of S positions, handed out as a request grows)."""
    positions = positions.to(cache_rows.device)
    if cache_rows.dim() == 1:
        return cache_rows.view(-1, 1).expand_as(positions), positions
    return cache_rows.gather(1, positions // seq_len), positions % seq_len


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a block of new tokens against a KV cache under a per-request tree mask.

    q:           [B, T, Hq, D]
    k/v_cache:   [N, Hkv, S, D], Hq a multiple of Hkv (GQA)
    cache_rows:  [B] integer, the cache row of request b, or a block table [B, MB] (see
                 kv_locations)
    prefix_lens: [B] integer, committed tokens of request b; the T new tokens' K/V are
                 already stored at positions prefix_lens[b] .. prefix_lens[b] + T - 1
    tree_mask:   [B, T, M] bool, M >= T: covers the M cache slots s0 .. prefix_lens[b] + T - 1,
                 s0 = prefix_lens[b] + T - M; tree_mask[b, i, j]: new token i may attend to slot
                 s0 + j. With M == T the mask covers exactly the new tokens; M > T lets a new level
                 of a token tree see its ancestors among nodes already in the cache (an SSM
                 decoding the tree level by level).
    Query i of request b sees every slot before s0 and the masked slots its mask allows.
    A query that sees nothing (a padding row) gets zeros.
    """
    B, T, Hq, D = q.shape
    Hkv, S, M = k_cache.shape[1], k_cache.shape[2], tree_mask.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(prefix_lens[b])
        rows, slots = kv_locations(cache_rows[b : b + 1], torch.arange(n + T)[None], S)
        # [L, Hkv, D] -> [Hq, L, D]
        k = k_cache[rows[0], :, slots[0]].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        v = v_cache[rows[0], :, slots[0]].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        visible = torch.cat(
            [torch.ones(T, n + T - M, dtype=torch.bool, device=q.device), tree_mask[b].bool()],
            dim=1,
        )  # [T, L]
        scores = torch.einsum("thd,hld->htl", q[b].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
        out[b] = torch.einsum("htl,hld->thd", probs, v).to(q.dtype)
    return out


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    """The compiled kernel when available, else the reference (same semantics).

    On cuda, checking cache_rows and prefix_lens (a clear error for an index out of range) copies
    them to the host and waits for the GPU; callers that build them (the models) pass
    check_indices=False. Unchecked, a key at an out-of-range row or block is skipped, never read.
    """
    if _C is None:
        return tree_attention_reference(
            q, k_cache, v_cache, cache_rows, prefix_lens, tree_mask, scale
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
    _C.tree_attention(
        q, k_cache, v_cache, cache_rows, prefix_lens, tree_mask, out, scale, stream, check_indices
    )
    return out


# The compiled CPU linear streams the weight once for all rows: a bandwidth-bound GEMV for decode
# and small tree blocks. Measured against torch.nn.functional.linear on all SmolLM2-135M
# projections (weights cold in memory): bfloat16 1.3-1.5x faster at 1 row and 4-5.5x at 8-64
# rows; float32 1.06x (1 thread) to 1.6x (2 threads) at 1 row, 1.2-1.8x at 20, but 0.83-0.97x at
# 64 rows, hence its smaller blocks. On AVX2 CPUs (no AVX-512) the engine packs its weights for
# an outer-product kernel instead (pack_linear); benchmarks/results/README.md has both layouts by
# row count, and the float32 decode steps it saves there (torch's float32 linear is several
# times slower than the packed kernel on such a CPU). float32 stays opt-in for now
# (SPECINFER_FAST_LINEAR_FP32=1): the model tests pass with it, but the one CI run with it on by
# default failed the DSI sampling test (see benchmarks/results/README.md), not yet explained.
FAST_LINEAR_FP32 = os.environ.get("SPECINFER_FAST_LINEAR_FP32", "0") == "1"
FAST_LINEAR_MAX_ROWS = {torch.bfloat16: 64, torch.float32: 32}  # rows per kernel call


def compiled_linear_dtype(dtype: torch.dtype) -> bool:
    """Whether CPU projections in `dtype` run the compiled kernel (so an OpGraph can hold them)."""
    return (
        _C is not None
        and dtype in FAST_LINEAR_MAX_ROWS
        and (dtype != torch.float32 or FAST_LINEAR_FP32)
    )


def _use_compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # Runs for every projection of every step: only cheap tests (no device objects, no generators).
    if not (x.is_cpu and weight.is_cpu and compiled_linear_dtype(x.dtype)):
        return False
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    if x.dim() == 0 or weight.dim() not in (2, 3) or weight.stride(-1) != 1 or x.shape[-1] == 0:
        return False
    return x.numel() > 0


def panels_preferred(dtype: torch.dtype) -> bool:
    """Whether this CPU's fastest linear for `dtype` takes weights packed in panels (the AVX2
    kernel, csrc/cpu/linear_panels.cpp; `bench_spec.py --sections rows` times both layouts)."""
    name = str(dtype).removeprefix("torch.")
    return compiled_linear_dtype(dtype) and _C.linear_panels_preferred(name)


def pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] as [N / 16, K, 16] panels where `panels_preferred` (and N is a multiple
    of 16); None where it is best left as it is. For inference only: `linear` takes the packed
    weight in place of the weight, in compiled, gradient-free calls. The panel kernel sums in
    another order than the unpacked one, so a model packs (`layers.pack_linears`) before its
    first forward: each weight is then always summed the same way."""
    if not (
        weight.dim() == 2
        and weight.is_cpu
        and weight.shape[0] % 16 == 0
        and weight.shape[1] > 0
        and panels_preferred(weight.dtype)
    ):
        return None
    packed = torch.empty(weight.shape[0] // 16, weight.shape[1], 16, dtype=weight.dtype)
    _C.pack_linear_panels(weight.detach(), packed)
    return packed


def weight_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a weight [N, K], packed (`pack_linear`) or not: [*ids.shape, K]. An
    embedding lookup, also where the table is a packed LM head's weight."""
    if weight.dim() == 2:
        return torch.nn.functional.embedding(ids, weight)
    slots = _panel_slots(weight.dtype, weight.device)
    return weight[ids // 16, :, slots[ids % 16]]


_SLOTS: dict = {}


def _panel_slots(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _SLOTS:
        name = str(dtype).removeprefix("torch.")
        _SLOTS[key] = torch.tensor(_C.linear_panel_slots(name), device=device)
    return _SLOTS[key]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias. The single place every model projection goes through, so a
    faster kernel (e.g. a bandwidth-bound bf16 GEMV for decode) can be swapped in here. `weight`
    may be packed (`pack_linear`)."""
    if not _use_compiled_linear(x, weight, bias):
        if weight.dim() == 3:
            raise ValueError(
                "linear: a packed weight (pack_linear) runs only in the compiled CPU kernel: "
                f"x {x.dtype} on {x.device}, weight {weight.dtype}, no gradients"
            )
        refuse_while_recording("linear")
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_features = weight.shape[0] * (16 if weight.dim() == 3 else 1)
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype)
    # Any number of rows runs in blocks through the kernel, never torch: a row's result must not
    # depend on how many rows share the call (speculation and batching are bit-exact that way),
    # and torch's CPU bf16 matmul is several times slower anyway (no AVX512-BF16 here).
    step = FAST_LINEAR_MAX_ROWS[x.dtype]
    for i in range(0, x2.shape[0], step):
        _C.linear(x2[i : i + step], weight, bias, out[i : i + step])
    return out.view(*x.shape[:-1], out_features)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a [N, K] weight for linear_int8: per row, scale = max |w| / 127 (float32)
    and codes = round(w / scale) + 128 (uint8, 1..255)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp(-127, 127) + 128
    return codes.to(torch.uint8).contiguous(), scale.contiguous()


def linear_int8_reference(x, codes, scale, bias=None) -> torch.Tensor:
    """What linear_int8 computes: each row of x quantized to int8 by its own scale (max |x| / 127),
    exact integer dot products with the codes less their zero point, both scales applied."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
    xq = torch.round((xf * (1 / x_scale)).clamp(-127, 127))
    dots = (xq.double() @ (codes.double() - 128).T).float()  # exact: |sums| < 2^53
    y = dots * (x_scale * scale.float())
    return (y if bias is None else y + bias.float()).to(x.dtype)


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """y = x @ W^T + bias with W as 8-bit codes (quantize_int8), for draft models on the CPU:
    half the bytes of bf16 to stream per call. x is quantized per row, so y is close to, not
    equal to, the full-precision product (drafts only propose: verification stays exact)."""
    if _C is None or not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):
        refuse_while_recording("linear_int8")
        return linear_int8_reference(x, codes, scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], codes.shape[0], dtype=x.dtype)
    _C.linear_int8(x2, codes, scale, bias, out)
    return out.view(*x.shape[:-1], codes.shape[0])


def kv_commit_reference(
    caches: list[torch.Tensor],
    cache_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Depth-first KV commit, in place: the accepted tree nodes' K/V move to consecutive slots.

    caches:      K and V of every layer, each [N, Hkv, S, D]
    cache_rows:  [B] integer, the cache row of request b, or a block table [B, MB] (see
                 kv_locations)
    prefix_lens: [B] integer, slots before the tree; tree node i is stored at prefix_lens[b] + i
    accepted:    [B, A] integer, the accepted root-to-node path (node indices, increasing, parents
                 before children), -1 padded
    For a = 0, 1, ... while accepted[b, a] >= 0: slot prefix + accepted[b, a] is copied to slot
    prefix + a. Copying in order is safe: accepted[b, a] >= a, so no source is overwritten first.
    """
    seq_len = caches[0].shape[2]
    for b in range(accepted.shape[0]):
        n = int(prefix_lens[b])
        for a, node in enumerate(accepted[b].tolist()):
            if node < 0:
                break
            where = torch.tensor([[n + node, n + a]])
            (src_row, dst_row), (src, dst) = (x[0].tolist() for x in
                                             kv_locations(cache_rows[b : b + 1], where, seq_len))  # fmt: skip
            for cache in caches:
                cache[dst_row, :, dst] = cache[src_row, :, src]


def kv_commit(
    caches: list[torch.Tensor],
    cache_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """The compiled commit when available, else the reference (same semantics)."""
    if _C is None:
        return kv_commit_reference(caches, cache_rows, prefix_lens, accepted)
    device = caches[0].device if caches else torch.device("cpu")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    # The kernel checks the indices on the host before it writes anything.
    indices = [t.detach().cpu() for t in (cache_rows, prefix_lens, accepted)]
    _C.kv_commit([c.detach() for c in caches], *indices, stream)


def _check_topk_args(logits: torch.Tensor, k: int, temperature: float) -> None:
    vocab = logits.shape[-1]
    if not 0 <= k <= vocab:
        raise ValueError(
            f"topk_expand: k = {k} must be in [0, {vocab}] (the vocabulary size, logits.shape[1])"
        )
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"topk_expand: temperature must be finite and >= 0, got {temperature}")


def topk_expand_reference(
    logits: torch.Tensor, k: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of softmax(logits / temperature) per row, best first.

    logits: [N, V] float32 or bfloat16. Temperature 0 (greedy decoding) means 1.0 here: a greedy
    tree still ranks its children by the plain softmax. Ties (equal logits) go to the lower token
    id. Returns tokens [N, k] int64 and their probabilities under the full softmax [N, k] float32.
    """
    _check_topk_args(logits, k, temperature)
    x = logits.float()
    probs = torch.softmax(x.double() / (temperature or 1.0), dim=-1).float()
    # Ranking by logit is ranking by probability, without ties made by rounding.
    tokens = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return tokens, probs.gather(-1, tokens)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum over the last dim (int64, shape logits.shape[:-1]); a NaN
    counts as the maximum, as in torch.max, which is the fallback off the compiled path. Every
    greedy token of a step comes through here: torch's max took 70 us for a tree's 6 rows of
    49152 logits, the kernel (two threads over rows) 19."""
    compiled = (_C is not None and logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)
                and logits.dim() >= 1 and logits.shape[-1] > 0 and logits.stride(-1) == 1)  # fmt: skip
    if not compiled:
        return logits.max(dim=-1).indices
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    _C.argmax(rows.detach(), out)
    return out.reshape(logits.shape[:-1])


def apply_penalties(logits, prompt_tokens, output_ids, branches, vocab_ids, vocab_size,
                    repetition, presence, frequency) -> torch.Tensor | None:  # fmt: skip
    """The compiled path of `sampling.Penalties.apply` (its semantics, there): the penalised
    float32 copy of cpu `logits` [rows, columns]; None where the kernel cannot run (no compiled
    core, logits off the cpu), for the caller's torch path."""
    if _C is None or not logits.is_cpu or logits.dim() != 2:
        return None
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    vocab_ids = None if vocab_ids is None else vocab_ids.cpu()
    _C.apply_penalties(out, prompt_tokens, output_ids, branches, vocab_ids, vocab_size,
                       repetition, presence, frequency)  # fmt: skip
    return out


def topk_expand(
    logits: torch.Tensor, k: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled kernel for cpu and cuda tensors (k <= 64 on cuda), else the reference (same
    semantics)."""
    if _C is None or logits.device.type not in ("cpu", "cuda"):
        return topk_expand_reference(logits, k, temperature)
    _check_topk_args(logits, k, temperature)
    tokens = torch.empty(logits.shape[0], k, dtype=torch.int64, device=logits.device)
    probs = torch.empty(logits.shape[0], k, dtype=torch.float32, device=logits.device)
    stream = torch.cuda.current_stream(logits.device).cuda_stream if logits.is_cuda else 0
    _C.topk_expand(logits.detach(), k, temperature, tokens, probs, stream)
    return tokens, probs


# --- fused decoder-layer ops (rms_norm, rotary, silu_mul, kv_write) ---
# At decode sizes a torch op costs more in dispatch than in arithmetic; each of these replaces
# several. The wrappers only pick the path; the kernels check their arguments themselves.


def _fused_on_cpu(x: torch.Tensor) -> bool:
    return _C is not None and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, rounded as HF Llama does: normalise in float32,
    cast to x's dtype, then scale in that dtype. With `residual` (a decoder layer's residual
    stream), first residual += x in place, and residual is what gets normalised."""
    if residual is not None:
        x = residual.add_(x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The compiled kernel for cpu tensors, else the reference (same semantics)."""
    if not _fused_on_cpu(x):
        refuse_while_recording("rms_norm")
        return rms_norm_reference(x, weight, eps, residual)
    out = torch.empty_like(x)
    _C.rms_norm(x, weight, residual, out, eps)
    return out


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotates q [..., heads, D] and k [..., kv_heads, D] in place by their positions' angles, in
    HF's rotate_half layout: x * cos + rotate_half(x) * sin, with the tables cos/sin
    [max_positions, D] (float32 or q's dtype) looked up at positions (q's leading dims) and cast
    to q's dtype."""
    c = cos[positions].unsqueeze(-2).to(q.dtype)
    s = sin[positions].unsqueeze(-2).to(q.dtype)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * c + torch.cat([-x2, x1], dim=-1) * s)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """The compiled kernel for cpu tensors, else the reference (same semantics)."""
    if not _fused_on_cpu(q):
        refuse_while_recording("rotary")
        return rotary_reference(q, k, cos, sin, positions)
    _C.rotary(q, k, cos, sin, positions)


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along the last dim (a fused gate/up projection)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """The compiled kernel for cpu tensors, else the reference (same semantics)."""
    if not _fused_on_cpu(x):
        refuse_while_recording("silu_mul")
        return silu_mul_reference(x)
    # Sizes as ints: torch.empty parses a torch.Size argument several microseconds slower.
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
    _C.silu_mul(x, out)
    return out


def kv_write_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_rows: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Stores k/v [B, T, kv_heads, D] into the caches [rows, kv_heads, seq, D] at request b's
    position slots[b, t] (cache_rows: its row [B] or block table [B, MB], see kv_locations)."""
    rows, slots = kv_locations(cache_rows, slots, k_cache.shape[2])
    k_cache[rows, :, slots] = k.to(k_cache.dtype)
    v_cache[rows, :, slots] = v.to(v_cache.dtype)


def kv_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_rows: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The compiled kernel for cpu tensors of the cache's dtype, else the reference."""
    if not _fused_on_cpu(k) or k.dtype != k_cache.dtype:
        refuse_while_recording("kv_write")
        return kv_write_reference(k_cache, v_cache, k, v, cache_rows, slots)
    _C.kv_write(k_cache, v_cache, k, v, cache_rows, slots)
