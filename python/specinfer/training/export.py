"""Export a student as an HF-format model directory.

config.json is a standard LlamaForCausalLM config (HF transformers loads a full export), plus a
"specinfer" entry: the source layers and, for a compact export, `shared_embeddings: true`
(no embedding/LM-head weights in the file, layers in bfloat16; it loads only as an SSM of its
target, whose tensors it shares). head_tokens.json lists token ids by descending frequency in the
teacher's completions (then prompts), for a speculator's restricted LM head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, processors
from torch import nn

from specinfer.tokenizer import TokenizerWrapper


def export_student(
    student: nn.Module,
    out_dir: str | Path,
    tokenizer: TokenizerWrapper,
    head: list[int],
    info: dict,
    compact: bool = False,
) -> Path:
    """`info`: what made the student (source layers, settings), kept in config.json."""
    # Written beside the destination, then renamed: a directory there is always complete.
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = torch.bfloat16 if compact else torch.float32
    config = hf_config(student.config, dtype)
    config["specinfer"] = {**info, "shared_embeddings": compact}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: t.to(dtype).contiguous() for name, t in hf_state_dict(student).items()
               if not (compact and name in ("model.embed_tokens.weight", "lm_head.weight"))}  # fmt: skip
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    _save_tokenizer(tokenizer, tmp)
    ids = {"bos_token_id": student.config.bos_token_id, "eos_token_id": student.config.eos_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2))
    (tmp / "head_tokens.json").write_text(json.dumps({"tokens": head}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def hf_config(cfg, dtype: torch.dtype) -> dict:
    config = {
        "architectures": [
            "SpecinferFeatureHead" if cfg.architecture == "feature" else "LlamaForCausalLM"
        ],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": cfg.activation,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling is not None:
        config["rope_scaling"] = cfg.rope_scaling
    if cfg.feature_layers:
        config["feature_layers"] = list(cfg.feature_layers)
    return config


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under HF checkpoint names (fused q/k/v and gate/up split again)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        elif name != "lm_head.weight" or not cfg.tie_word_embeddings:
            out[name] = t
    return out


def _save_tokenizer(tokenizer: TokenizerWrapper, out_dir: Path) -> None:
    """tokenizer.json (with BOS added by its post-processor when the source adds it, as an HF
    directory expects) and tokenizer_config.json with the special tokens and chat template."""
    tok = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    if tokenizer.add_bos:
        bos = tokenizer.bos_token
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.bos_token_id)],
        )  # fmt: skip
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token, "chat_template": tokenizer.chat_template}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
