"""Llama (and Mistral, SmolLM2, ...) decoder with tree attention over a KV cache.

Module names follow HF's, so checkpoint names map one-to-one except the fused projections
listed in `packed_weights`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from specinfer import ops
from specinfer.distributed.group import current_stage, stage_layers
from specinfer.kv_cache import KVCache
from specinfer.layers import (
    ACTIVATIONS,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    kv_heads_per_rank,
)
from specinfer.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = divide(cfg.num_heads, "attention heads")
        self.num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads)
        self.heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]  # of q, k, v
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        )

    def forward(self, x, rotary, positions, kv, cache_rows, prefix_lens, slots, tree_mask):
        B, T, _ = x.shape
        # One view and a split by heads; Tensor.split's Python wrapper costs more than the op.
        qkv = self.qkv_proj(x).view(B, T, -1, self.head_dim)
        q, k, v = qkv.split_with_sizes(self.heads, dim=2)
        rotary(q, k, positions)
        kv.write(self.layer, k, v, cache_rows, slots)
        out = kv.attend(self.layer, q, cache_rows, prefix_lens, tree_mask)
        return self.o_proj(out.reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.is_silu = cfg.activation == "silu"

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.is_silu:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    keep_input = False  # set by LlamaForCausalLM.tap

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.kept_input = None

    def forward(self, h, residual, *attn_args):
        """h: the previous layer's output; residual: the stream it is added to (None in the first
        layer, whose h is the embedding). Each residual add is fused into the norm after it."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x = self.input_layernorm(h, residual)
        if self.keep_input:
            self.kept_input = x  # a new tensor, which nothing after writes to
        x = self.post_attention_layernorm(self.self_attn(x, *attn_args), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """Under pipeline parallelism only this stage's layers (and the embedding on the first
        stage, the final norm on the last) hold weights; the rest are built on the meta device
        (no memory, skipped by the loader) so names and layer indices stay the model's."""
        super().__init__()
        stage, stages = current_stage()
        self.owned = stage_layers(cfg.num_layers, stage, stages)
        first, last = stage == 0, stage == stages - 1
        keep_embed = first or (last and cfg.tie_word_embeddings)  # the tied head reads it
        with _here_or_meta(keep_embed):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        layers = []
        for i in range(cfg.num_layers):
            with _here_or_meta(i in self.owned):
                layers.append(LlamaDecoderLayer(cfg, i))
        self.layers = nn.ModuleList(layers)
        with _here_or_meta(last):
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


def _here_or_meta(here: bool):
    """Build on the current device, or (not this stage's part) on the meta device."""
    return contextlib.nullcontext() if here else torch.device("meta")


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter's name fragment, shard id)
    packed_weights = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        stage, stages = current_stage()
        self.stage, self.stages = stage, stages
        with _here_or_meta(stage == stages - 1):
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tapped: tuple[int, ...] = ()  # see tap
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        cache_rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [B, T, H] of T new tokens per request (see `ops.tree_attention`)."""
        T = input_ids.shape[1]
        slots = prefix_lens[:, None] + torch.arange(T, device=input_ids.device)
        h = self.embed(input_ids)
        return self.decode(h, positions, kv, cache_rows, prefix_lens, slots, tree_mask)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    # With SiLU every op of `decode` is a compiled one, so an OpGraph can record it (offloaded
    # layers: in segments, see graphs._Recorded).
    @property
    def graph_safe(self) -> bool:
        return (self.config.activation == "silu" and self.lm_head.tp.size == 1
                and self.stages == 1 and ops.compiled_linear_dtype(self.lm_head.weight.dtype))  # fmt: skip

    def decode(self, h, positions, kv, cache_rows, prefix_lens, slots, tree_mask) -> torch.Tensor:
        """The layers and the final norm over embedded tokens h [B, T, H] (updated in place);
        new K/V go to cache slots `slots` [B, T]."""
        residual = None
        for layer in self.model.layers:
            h, residual = layer(
                h, residual, self.rotary, positions, kv, cache_rows, prefix_lens, slots, tree_mask
            )
        return self.model.norm(h, residual)

    def run_stage(self, h, residual, positions, kv, cache_rows, prefix_lens, tree_mask):
        """A pipeline stage: its layers over h [B, T, H] and the residual stream (None on the
        first stage, where h is the embedding); (h, residual) for the next stage."""
        slots = prefix_lens[:, None] + torch.arange(h.shape[1], device=h.device)
        for i in self.model.owned:
            h, residual = self.model.layers[i](
                h, residual, self.rotary, positions, kv, cache_rows, prefix_lens, slots, tree_mask
            )
        return h, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def tap(self, layers: tuple[int, ...]) -> None:
        """From now on keep the normalised inputs of these decoder layers at every forward (a
        feature head reads them, models/feature_head.py): `taps()` gives the last forward's."""
        for i, layer in enumerate(self.model.layers):
            layer.keep_input = i in layers
        self.tapped = tuple(layers)

    def taps(self) -> list[torch.Tensor]:
        return [self.model.layers[i].kept_input for i in self.tapped]

    def make_kv_cache(self, rows: int, max_seq_len: int, dtype: torch.dtype | None = None):
        attn = self.model.layers[self.model.owned[0]].self_attn
        weight = attn.qkv_proj.weight
        return KVCache(
            self.config.num_layers,
            rows,
            attn.num_kv_heads,
            max_seq_len,
            attn.head_dim,
            dtype or weight.dtype,
            weight.device,
            layers=self.model.owned,
        )
