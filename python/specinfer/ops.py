"""Thin wrappers over the compiled core (`specinfer._C`), each with a pure-torch reference.

The references define the semantics; tests compare the kernels against them.
"""

from __future__ import annotations

import math

import torch

try:
    from specinfer import _C
except ImportError:  # pragma: no cover - only when the extension was not built
    _C = None


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
    cache_rows:  [B] integer, the cache row of request b
    prefix_lens: [B] integer, committed tokens of request b; the T new tokens' K/V are
                 already stored at positions prefix_lens[b] .. prefix_lens[b] + T - 1
    tree_mask:   [B, T, T] bool, tree_mask[b, i, j]: new token i may attend to new token j
    Query i of request b sees every committed position and the new tokens its mask allows.
    A query that sees nothing (a padding row) gets zeros.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        row, n = int(cache_rows[b]), int(prefix_lens[b])
        k = k_cache[row, :, : n + T].float().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, L, D]
        v = v_cache[row, :, : n + T].float().repeat_interleave(Hq // Hkv, dim=0)
        visible = torch.cat(
            [torch.ones(T, n, dtype=torch.bool, device=q.device), tree_mask[b].bool()], dim=1
        )  # [T, L]
        scores = torch.einsum("thd,hld->htl", q[b].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
        out[b] = torch.einsum("htl,hld->thd", probs, v).to(q.dtype)
    del S
    return out


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The compiled kernel when available, else the reference (same semantics)."""
    if _C is None:
        return tree_attention_reference(q, k_cache, v_cache, cache_rows, prefix_lens, tree_mask, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    # __dlpack__ refuses tensors that require grad; the kernel is inference-only anyway.
    args = [t.detach() for t in (q, k_cache, v_cache, cache_rows, prefix_lens, tree_mask)]
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
    _C.tree_attention(*args, out, scale, stream)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias. The single place every model projection goes through, so a
    faster kernel (e.g. a bandwidth-bound bf16 GEMV for decode) can be swapped in here."""
    return torch.nn.functional.linear(x, weight, bias)
