"""Tensor-parallel building blocks (Megatron-style) over the group they are built in
(`distributed.tensor_parallel`; a single rank outside one).

Every parameter carries a `weight_loader(param, full_tensor, shard_id=None)` that copies this
rank's slice of the full checkpoint tensor, so the loader never needs to know about sharding.
Fused parameters (qkv, gate/up) also carry `shard_ids`, the shards that must all be loaded.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from specinfer import ops
from specinfer.distributed.group import current_group

ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def divide(n: int, what: str) -> int:
    world = current_group().size
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel world size {world}")
    return n // world


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """Key/value heads a rank holds: its share, or with more ranks than heads one head, each
    replicated on world / num_kv_heads ranks (as vLLM does)."""
    world = current_group().size
    if world <= num_kv_heads:
        return divide(num_kv_heads, "key/value heads")
    if world % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel world size {world} exceeds the key/value heads "
            f"({num_kv_heads}) and is not a multiple of them, so they cannot be replicated evenly"
        )
    return 1


def _check_shape(full: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(full.shape) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(full.shape)}")


def default_weight_loader(param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
    """Replicated parameter: every rank holds the whole tensor."""
    _check_shape(full, param.shape)
    param.data.copy_(full)


# The dtype parameters are made in while a model is built (`params_in`): the dtype it will run
# in, so its weights are not first made float32 and converted (0.3 s for the default model's 135M
# weights, before the checkpoint overwrote them).
_PARAMS_DTYPE: ContextVar[torch.dtype] = ContextVar("params_dtype", default=torch.float32)


@contextmanager
def params_in(dtype: torch.dtype):
    token = _PARAMS_DTYPE.set(dtype)
    try:
        yield
    finally:
        _PARAMS_DTYPE.reset(token)


def _param(*shape: int, loader=default_weight_loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=_PARAMS_DTYPE.get()), requires_grad=False)
    p.weight_loader = loader
    return p


class ReplicatedEmbedding(nn.Module):
    """A small table every rank holds whole (e.g. OPT's learned positions)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Projection(nn.Module):
    """What every linear layer shares: x @ weight^T, or through 8-bit codes of the weight once
    `quantize_int8` made them (draft models: half the bytes streamed per call; the weight stays,
    for its dtype and for training)."""

    quantizable = True  # False: quantize_int8 of a whole model leaves it as loaded

    def __init__(self):
        super().__init__()
        self.register_buffer("codes", None, persistent=False)
        self.register_buffer("codes_scale", None, persistent=False)

    def quantize_int8(self) -> None:
        self.codes, self.codes_scale = ops.quantize_int8(self.weight)

    def pack(self) -> None:
        """The weight in the layout of this CPU's fastest linear kernel, in place of its rows
        (ops.pack_linear), where there is one: for inference, once loaded (and quantized)."""
        if self.codes is None:
            _pack_weight(self.weight)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.codes is None:
            return ops.linear(x, self.weight, bias)
        return ops.linear_int8(x, self.codes, self.codes_scale, bias)


class ReplicatedLinear(Projection):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class ColumnParallelLinear(Projection):
    """y = x W^T with W's output features split across ranks; the output stays sharded.

    `out_sizes` lists the fused sub-projections (full sizes); each is split separately so a
    rank holds the matching slice of every one of them, e.g. its q, k and v heads."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, shard_ids=None,
                 local_sizes: list[int] | None = None):  # fmt: skip
        super().__init__()
        self.tp = current_group()
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.local_sizes = local_sizes or [divide(n, "output features") for n in out_sizes]
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        self.weight = _param(sum(self.local_sizes), in_features, loader=self.weight_loader)
        self.bias = _param(sum(self.local_sizes), loader=self.weight_loader) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.shard_ids = set(self.shard_ids)

    def shard_start(self, i: int) -> int:
        """Where this rank's slice of sub-projection i starts in the full tensor."""
        return self.tp.rank * self.local_sizes[i]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        i = self.shard_ids.index(shard_id)
        _check_shape(full, (self.out_sizes[i], *param.shape[1:]))
        n, start = self.local_sizes[i], self.shard_start(i)
        offset = sum(self.local_sizes[:i])
        param.data[offset : offset + n].copy_(full[start : start + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        local_kv = kv_heads_per_rank(num_kv_heads) * head_dim
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        local = [divide(sizes[0], "attention heads x head_dim"), local_kv, local_kv]
        super().__init__(hidden, sizes, bias, shard_ids=("q", "k", "v"), local_sizes=local)

    def shard_start(self, i: int) -> int:
        world = self.tp.size
        if i == 0 or world <= self.num_kv_heads:
            return super().shard_start(i)
        return self.tp.rank // (world // self.num_kv_heads) * self.head_dim  # a replicated head


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input (e.g. gate and up), shard ids 0, 1, ..."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__(in_features, out_sizes, bias, shard_ids=range(len(out_sizes)))


class RowParallelLinear(Projection):
    """y = x W^T with W's input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = current_group()
        self.in_features = in_features
        self.weight = _param(out_features, divide(in_features, "input features"))
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _check_shape(full, (param.shape[0], self.in_features))
        n = param.shape[1]
        param.data.copy_(full[:, self.tp.rank * n : (self.tp.rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by rank 0, before the sum.
        y = self.project(x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y) if self.tp.size > 1 else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up its own ids, others give 0."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.tp = current_group()
        self.vocab_size = vocab_size
        self.shard = divide(vocab_size, "vocabulary size")
        self.start = self.tp.rank * self.shard
        self.weight = _param(self.shard, dim, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _check_shape(full, (self.vocab_size, param.shape[1]))
        param.data.copy_(full[self.start : self.start + self.shard])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The table may be a packed LM head's weight (tied embeddings): ops.weight_rows reads both.
        if self.tp.size == 1:
            return ops.weight_rows(self.weight, ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.shard)
        out = ops.weight_rows(self.weight, local.clamp(0, self.shard - 1)) * mine.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary range, gathered into full float32 logits."""

    def pack(self) -> None:
        """As Projection.pack; a tied embedding reads the packed table (ops.weight_rows)."""
        _pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(x, self.weight).float()
        if self.tp.size == 1:
            return logits
        return torch.cat(self.tp.all_gather(logits), dim=-1)


def _pack_weight(weight: nn.Parameter) -> None:
    if weight.dim() == 2:  # else packed already (a layer or head shared with another model)
        packed = ops.pack_linear(weight)
        if packed is not None:
            weight.data = packed


def pack_linears(model: nn.Module, head: bool = True) -> None:
    """Every projection of `model` packed for this CPU's fastest linear (Projection.pack), where
    that kernel takes packed weights. Shared layers are packed once. `head`:
    the LM head too (not on the ranks of a distributed model: its head shards travel whole)."""
    for module in model.modules():
        if isinstance(module, Projection) or (head and isinstance(module, ParallelLMHead)):
            module.pack()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised x, or with `residual`: residual += x in place, then normalised residual
        (see `ops.rms_norm_reference`)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, elementwise_affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = _param(dim) if elementwise_affine else None
        self.bias = _param(dim) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """HF-style (rotate_half) rotary embedding with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32),
            rope_inv_freq(head_dim, theta, scaling),
        )
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate q, k [B, T, H, D] in place by the angles of positions [B, T]."""
        ops.rotary(q, k, self.cos, self.sin, positions)
