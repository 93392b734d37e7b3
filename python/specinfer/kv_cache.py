"""The key/value cache: one K and one V tensor per layer, laid out [rows, kv_heads, seq, head_dim].

A request owns one row. Its committed tokens occupy positions 0 .. prefix_len - 1; the tokens of
the current step are written right after them before attention runs.
"""

from __future__ import annotations

import math
import mmap

import torch

from specinfer import ops

# A cache kept from batch to batch grows in steps of this many tokens: a request a little longer
# than the last then reuses it, and the graphs recorded over it (graphs.py), instead of
# re-recording every shape (an eager forward each) whenever a new longest request comes.
SEQ_BLOCK = 256


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, but on the CPU in memory mapped for it alone (anonymous, private): the OS
    hands out its pages zeroed as they are first touched, so a cache costs what its requests use.
    torch.zeros writes every byte up front: the default model's cache (16 requests x 2048
    tokens, 754 MB) took ~0.4 s of a fresh engine's first request, which then generated 64
    tokens in ~1.2 s. (calloc is no substitute: once big blocks have been freed, malloc serves
    the next ones from its heap and clears them byte by byte.)"""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, nbytes, flags=private) if private else mmap.mmap(-1, nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def kept_capacity(max_seq_len: int) -> int:
    """The sequence length to allocate for a cache that will be kept: whole SEQ_BLOCKs."""
    return -(-max_seq_len // SEQ_BLOCK) * SEQ_BLOCK


class KVCache:
    def __init__(
        self,
        num_layers: int,
        rows: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layers: range | None = None,
    ):
        """layers: the ones this cache holds (a pipeline stage's); the others get empty
        tensors, so a layer's index is the same everywhere."""
        shape = (rows, num_kv_heads, max_seq_len, head_dim)
        held = range(num_layers) if layers is None else layers

        def one(i: int) -> torch.Tensor:
            return zeros(shape if i in held else (0,), dtype, device)

        self.k = [one(i) for i in range(num_layers)]
        self.v = [one(i) for i in range(num_layers)]
        self.held = held
        self.rows = rows
        self.max_seq_len = max_seq_len

    def holds(self, rows: int, max_seq_len: int) -> bool:
        """Whether a batch of `rows` requests of up to `max_seq_len` tokens fits in this cache."""
        return self.rows >= rows and self.max_seq_len >= max_seq_len

    def write(
        self,
        layer: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        cache_rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Store k/v_new [B, T, Hkv, D] at row cache_rows[b], sequence slot slots[b, t].

        Slots are storage positions (prefix_len + t), not RoPE positions: in a token tree
        the RoPE position is prefix_len + depth, and siblings share it."""
        ops.kv_write(self.k[layer], self.v[layer], k_new, v_new, cache_rows, slots)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        cache_rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Tree attention of q [B, T, Hq, D] over this layer's cache (see ops.tree_attention).
        The engine built the indices, so they are not checked again: on cuda that would copy
        them to the host and wait for the GPU in every layer."""
        return ops.tree_attention(
            q, self.k[layer], self.v[layer], cache_rows, prefix_lens, tree_mask, check_indices=False
        )
