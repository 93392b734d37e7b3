"""One config type for every architecture, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF `architectures[0]` (or `model_type` when that is missing) -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "OPTForCausalLM": "opt",
    "SpecinferFeatureHead": "feature",  # ours: models/feature_head.py
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "opt": "opt"}
# "freq_factors": llama.cpp's per-frequency divisors (a GGUF `rope_freqs` tensor, Llama 3.1+).
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    activation: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # always has "rope_type" when set
    attention_bias: bool = False
    mlp_bias: bool = False
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    # Feature head: the target layers whose normalised inputs it reads besides the final
    # hidden state (models/feature_head.py); empty: the final hidden state alone
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_scaling['rope_type']!r}; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        names = d.get("architectures") or []
        if names:
            name = names[0]
            arch = HF_ARCHITECTURES.get(name)
        else:
            name = d.get("model_type")
            arch = HF_MODEL_TYPES.get(name)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {name!r}; supported: {', '.join(HF_ARCHITECTURES)}"
            )
        common = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )
        if arch == "opt":
            return cls(
                architecture="opt",
                num_kv_heads=d["num_attention_heads"],
                head_dim=d["hidden_size"] // d["num_attention_heads"],
                intermediate_size=d["ffn_dim"],
                activation=d.get("activation_function", "relu"),
                tie_word_embeddings=d.get("tie_word_embeddings", True),
                do_layer_norm_before=d.get("do_layer_norm_before", True),
                word_embed_proj_dim=d.get("word_embed_proj_dim") or d["hidden_size"],
                enable_bias=d.get("enable_bias", True),
                layer_norm_elementwise_affine=d.get("layer_norm_elementwise_affine", True),
                norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
                **common,
            )
        theta, scaling = _hf_rope(d)
        return cls(
            architecture=arch,  # "llama", or "feature" (a Llama-style feature head)
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            norm_eps=d.get("rms_norm_eps", 1e-6),
            activation=d.get("hidden_act", "silu"),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
            feature_layers=tuple(d.get("feature_layers", ())),
            **common,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tie_word_embeddings: bool) -> ModelConfig:
        """`meta` maps GGUF keys to values (with `llama.vocab_size` filled in). Tying is not in
        the metadata: a file without an `output.weight` tensor has tied embeddings."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")

        def get(key, default=None):
            return meta.get(f"llama.{key}", default)

        hidden, heads = get("embedding_length"), get("attention.head_count")
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        elif get("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling {get('rope.scaling.type')!r}")
        return cls(
            architecture="llama",
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=get("attention.key_length") or hidden // heads,
            intermediate_size=get("feed_forward_length"),
            max_position_embeddings=get("context_length", 2048),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_scaling=scaling,
        )


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling
