"""The student SSM: a subset of the target's layers, optionally with narrower MLPs.

The student shares the target's token embeddings and LM head (tied in SmolLM2) and never trains
them: they are 28M of SmolLM2-135M's 135M parameters, so sharing makes the SSM almost free in
memory; keeping them fixed keeps the student in the target's token space (its hidden states are
read by the target's own head); and the student's trainable part stays small (~3.5M parameters
a layer), which is what a CPU can distil in minutes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specinfer.layers import ACTIVATIONS
from specinfer.models import build_model


def parse_layers(spec: str, total: int) -> list[int]:
    """ "first:N" (the first N layers) or a comma list of layer indices, e.g. "0,1,2,29"."""
    try:
        if spec.startswith("first:"):
            n = int(spec.split(":", 1)[1])
            if not 1 <= n < total:
                raise ValueError(f"first:N needs 1 <= N < {total} (the target's depth), got {n}")
            return list(range(n))
        layers = sorted({int(x) for x in spec.split(",")})
    except ValueError as e:
        if "first:N" in str(e):
            raise
        raise ValueError(
            f"layers must be first:N or a comma list like 0,1,5; got {spec!r}"
        ) from None
    bad = [i for i in layers if not 0 <= i < total]
    if bad:
        raise ValueError(f"layers {bad} out of range: the target has layers 0..{total - 1}")
    if len(layers) == total:
        raise ValueError(f"selecting all {total} layers makes no smaller model")
    return layers


def build_student(target: nn.Module, layers: list[int], mlp_keep: float = 1.0) -> nn.Module:
    """A float32 model of the target's `layers` (copied, renumbered 0..n-1) and final norm, with
    the MLP's `mlp_keep` fraction of intermediate channels of largest weight norm, sharing the
    target's embedding and LM head tensors."""
    if target.config.architecture != "llama":
        raise ValueError(
            f"layer selection supports Llama-family targets, not {target.config.architecture}"
        )
    if not 0 < mlp_keep <= 1:
        raise ValueError(f"mlp_keep must be in (0, 1], got {mlp_keep}")
    width = max(1, round(mlp_keep * target.config.intermediate_size))
    config = dataclasses.replace(target.config, num_layers=len(layers), intermediate_size=width)
    student = build_model(config).float().eval()
    for i, src in enumerate(layers):
        state = target.model.layers[src].state_dict()
        if width < target.config.intermediate_size:
            state = _prune_mlp(state, width)
        student.model.layers[i].load_state_dict(state)
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    student.model.embed_tokens.weight = target.model.embed_tokens.weight
    student.lm_head.weight = target.lm_head.weight  # the same tensor as above when tied
    return student


def _prune_mlp(state: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Keep the `width` intermediate channels whose gate, up and down weights have the largest
    product of norms (in their original order)."""
    gate, up = state["mlp.gate_up_proj.weight"].chunk(2)
    down = state["mlp.down_proj.weight"]
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    keep = score.topk(width).indices.sort().values
    state = dict(state)
    state["mlp.gate_up_proj.weight"] = torch.cat([gate[keep], up[keep]])
    state["mlp.down_proj.weight"] = down[:, keep]
    if "mlp.gate_up_proj.bias" in state:
        b_gate, b_up = state["mlp.gate_up_proj.bias"].chunk(2)
        state["mlp.gate_up_proj.bias"] = torch.cat([b_gate[keep], b_up[keep]])
    return state


def train_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Hidden states [B, T, H] of a causal forward over right-padded ids from position 0, in
    differentiable torch ops (the inference kernels have no backward); same math as
    `LlamaForCausalLM.forward`."""
    h = F.embedding(ids, model.model.embed_tokens.weight)
    for layer in model.model.layers:
        h = train_layer(model, layer, h, _causal)
    return _rms_norm(h, model.model.norm)


def train_layer(model: nn.Module, layer: nn.Module, h: torch.Tensor, attend) -> torch.Tensor:
    """One decoder layer over h [B, T, H] (slot s at RoPE position s), in differentiable ops;
    attend(q, k, v) ([B, T, heads, D] each, rotated) gives the attention output [B, T, Hq, D]."""
    cfg = model.config
    B, T, _ = h.shape
    cos, sin = model.rotary.cos[:T, None, :], model.rotary.sin[:T, None, :]
    attn = layer.self_attn
    x = _rms_norm(h, layer.input_layernorm)
    qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).view(B, T, -1, cfg.head_dim)
    q, k, v = qkv.split_with_sizes(attn.heads, dim=2)
    out = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
    h = h + F.linear(out.reshape(B, T, -1), attn.o_proj.weight, attn.o_proj.bias)
    x = _rms_norm(h, layer.post_attention_layernorm)
    mlp = layer.mlp
    gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
    act = ACTIVATIONS[cfg.activation]
    return h + F.linear(act(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
