"""OPT decoder (learned positions, LayerNorm, pre- or post-LN) with tree attention over a KV cache.

Module names follow HF's (`model.decoder...`), so checkpoint names map one-to-one except the
fused q/k/v projection.
"""

from __future__ import annotations

import torch
from torch import nn

from specinfer.distributed.group import current_stage
from specinfer.kv_cache import KVCache
from specinfer.layers import (
    ACTIVATIONS,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedEmbedding,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
)
from specinfer.models.config import ModelConfig

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq legacy)


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = divide(cfg.num_heads, "attention heads")
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, cfg.enable_bias
        )
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, cfg.enable_bias)

    def forward(self, x, kv, cache_rows, prefix_lens, slots, tree_mask):
        B, T, _ = x.shape
        q, k, v = (
            t.view(B, T, self.num_heads, self.head_dim) for t in self.qkv_proj(x).chunk(3, dim=-1)
        )
        kv.write(self.layer, k, v, cache_rows, slots)
        out = kv.attend(self.layer, q, cache_rows, prefix_lens, tree_mask)
        return self.out_proj(out.reshape(B, T, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.pre_ln = cfg.do_layer_norm_before
        affine = cfg.layer_norm_elementwise_affine
        self.self_attn = OPTAttention(cfg, layer)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], cfg.enable_bias)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.enable_bias)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, affine)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, h, *attn_args):
        # Pre-LN normalises each sublayer's input; post-LN (OPT-350m) normalises after the residual.
        x = self.self_attn_layer_norm(h) if self.pre_ln else h
        h = h + self.self_attn(x, *attn_args)
        if not self.pre_ln:
            h = self.self_attn_layer_norm(h)
        x = self.final_layer_norm(h) if self.pre_ln else h
        h = h + self.fc2(self.act(self.fc1(x)))
        return h if self.pre_ln else self.final_layer_norm(h)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        proj_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, proj_dim)
        self.embed_positions = ReplicatedEmbedding(
            cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size
        )
        projected = proj_dim != cfg.hidden_size
        self.project_in = ReplicatedLinear(proj_dim, cfg.hidden_size, False) if projected else None
        self.project_out = ReplicatedLinear(cfg.hidden_size, proj_dim, False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layer_norm = (
            LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.layer_norm_elementwise_affine)
            if cfg.do_layer_norm_before
            else None
        )


class OPTForCausalLM(nn.Module):
    packed_weights = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        if current_stage()[1] > 1:
            raise ValueError("pipeline_parallel supports LLaMA-family models only (this is OPT)")
        self.config = config
        self.model = nn.Module()
        self.model.decoder = OPTDecoder(config)
        proj_dim = config.word_embed_proj_dim or config.hidden_size
        self.lm_head = ParallelLMHead(config.vocab_size, proj_dim)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        cache_rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [B, T, word_embed_proj_dim] (see `ops.tree_attention`)."""
        dec = self.model.decoder
        T = input_ids.shape[1]
        slots = prefix_lens[:, None] + torch.arange(T, device=input_ids.device)
        h = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            h = dec.project_in(h)
        h = h + dec.embed_positions(positions + POSITION_OFFSET)
        for layer in dec.layers:
            h = layer(h, kv, cache_rows, prefix_lens, slots, tree_mask)
        if dec.final_layer_norm is not None:
            h = dec.final_layer_norm(h)
        if dec.project_out is not None:
            h = dec.project_out(h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.decoder.layers

    def make_kv_cache(self, rows: int, max_seq_len: int, dtype: torch.dtype | None = None):
        attn = self.model.decoder.layers[0].self_attn
        weight = self.lm_head.weight
        return KVCache(
            self.config.num_layers,
            rows,
            attn.num_heads,
            max_seq_len,
            attn.head_dim,
            dtype or weight.dtype,
            weight.device,
        )
