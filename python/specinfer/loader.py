"""Load a model from a local HF directory (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specinfer.default_model import cache_dir
from specinfer.layers import params_in
from specinfer.models import ModelConfig, build_model

GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shared_embeddings_from: nn.Module | None = None,
) -> nn.Module:
    """A ready-to-run model (in eval mode, `model.config` set) from a directory or .gguf file.
    `shared_embeddings_from`: the target whose embedding and LM head tensors a compact SSM
    export (config.json "specinfer": {"shared_embeddings": true}) uses, without a copy."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        return _load_hf_dir(path, dtype, device, shared_embeddings_from)
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype, device)
    raise ValueError(f"{path} is neither a model directory nor a .gguf file")


def _build(config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
    with torch.device(device), params_in(dtype):
        model = build_model(config)
    return model.to(dtype).eval()  # the buffers (rotary tables) too


def _load_hf_dir(path: Path, dtype, device, shared_embeddings_from=None) -> nn.Module:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    hf_config = json.loads(config_file.read_text())
    config = ModelConfig.from_hf_config(hf_config)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"checkpoint file {f} (listed in {index.name}) is missing")

    total = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            total += len(st.keys())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    if "rotary_emb.inv_freq" in name:  # recomputed, saved by old versions
                        continue
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    # Old OPT checkpoints omit the `model.` prefix.
                    hf_name = "model." + name if name.startswith("decoder.") else name
                    yield hf_name, st.get_tensor(name)

    model = _build(config, dtype, device)
    shared = set()
    if hf_config.get("specinfer", {}).get("shared_embeddings"):
        shared = _share_embeddings(model, shared_embeddings_from, path)
    load_weights(model, tensors(), total, desc=f"loading {path.name}", preloaded=shared)
    return model


def _share_embeddings(model: nn.Module, target: nn.Module | None, path: Path) -> set[str]:
    """Point a compact SSM's embedding and LM head at its target's tensors."""
    if target is None:
        raise ValueError(
            f"{path} is a compact SSM without embeddings of its own; load it as the SSM of its "
            f"target (Engine(target, ssm=...), --ssm {path})"
        )
    want, have = model.config, target.config
    if (want.vocab_size, want.hidden_size) != (have.vocab_size, have.hidden_size):
        raise ValueError(
            f"{path} needs a target with vocabulary size {want.vocab_size} and hidden size "
            f"{want.hidden_size}; this target has {have.vocab_size} and {have.hidden_size}"
        )
    model.model.embed_tokens.weight = target.model.embed_tokens.weight
    model.lm_head.weight = target.lm_head.weight
    return {"model.embed_tokens.weight", "lm_head.weight"}


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)


def open_gguf(path: str | Path) -> GGUFReader:
    """A (memory-mapped) reader for a GGUF file; parsing takes seconds, so the model and the
    tokenizer share one reader."""
    path = Path(path).resolve()
    return _open_gguf(path, path.stat().st_mtime_ns)


def _load_gguf(path: Path, dtype, device) -> nn.Module:
    converted = converted_gguf(path)
    config, tensors, total = _read_converted(converted) if converted else _read_gguf(path)
    model = _build(config, dtype, device)
    load_weights(model, tensors(), total, desc=f"loading {path.name}")
    return model


def _read_gguf(path: Path) -> tuple[ModelConfig, Callable[[], Iterator], int]:
    """A GGUF file's config, its tensors (HF names, dequantised to float32) and their count."""
    reader = open_gguf(path)
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("tokenizer.") or key.endswith("_token_id")
    }
    by_name = {t.name: t for t in reader.tensors}
    arch = meta.get("general.architecture")
    if "token_embd.weight" in by_name:
        meta.setdefault(f"{arch}.vocab_size", int(by_name["token_embd.weight"].shape[1]))
    config = ModelConfig.from_gguf_metadata(
        meta, tie_word_embeddings="output.weight" not in by_name
    )
    supported = {GGMLQuantizationType[n] for n in GGUF_TYPES}

    def read(t) -> torch.Tensor:
        if t.tensor_type not in supported:
            raise ValueError(
                f"GGUF tensor {t.name!r} has quantisation type {t.tensor_type.name}, which is "
                f"not supported; supported: {', '.join(GGUF_TYPES)}"
            )
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # own, writable copy
        return torch.from_numpy(data).view(shape)

    if "rope_freqs.weight" in by_name:
        factors = read(by_name.pop("rope_freqs.weight")).tolist()
        config.rope_scaling = {"rope_type": "freq_factors", "factors": factors}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in by_name.items():
            w = read(t)
            hf_name = _gguf_to_hf_name(name)
            # llama.cpp's converter permutes q/k rows for its RoPE layout; undo it.
            if hf_name and hf_name.endswith("q_proj.weight"):
                w = _unpermute_rope(w, config.num_heads)
            elif hf_name and hf_name.endswith("k_proj.weight"):
                w = _unpermute_rope(w, config.num_kv_heads)
            yield hf_name or name, w

    return config, tensors, len(by_name)


# A GGUF file is read once: the gguf package takes ~6 s to parse the default model's tokenizer
# metadata and ~3 s to dequantise its tensors, so the first load writes what they give (the
# tensors as float32 safetensors, the config, the tokenizer) to a directory of the cache, and
# later loads read that (~0.7 s). $SPECINFER_GGUF_CACHE: that directory's parent ("0": off);
# default $SPECINFER_CACHE/gguf. A conversion is redone when the file or the code that converts
# it changes, and replaces the older conversions of files of its name (a file elsewhere of the
# same name is then converted again when it is next loaded: the cache keeps one per name).
_CONVERTER_SOURCES = ("loader.py", "tokenizer.py", "models/config.py")
_TENSORS = "tensors.safetensors"
# A conversion holds 4 bytes a weight: a larger model (a 7B one would take 28 GB) is read from
# its file at every load, as before.
MAX_CONVERTED_BYTES = 4 << 30
STALE_PARTIAL_S = 24 * 3600  # a half-written conversion (its process was killed) goes after a day
_PARTIAL = re.compile(r"\..+-[0-9a-f]{16}-[a-z0-9_]{8}")  # ".<conversion>-" + mkdtemp's suffix


def converted_gguf(path: str | Path) -> Path | None:
    """The directory a GGUF file converts to (converted here on first use); None where the
    cache is off or cannot be written (then read the file itself)."""
    setting = os.environ.get("SPECINFER_GGUF_CACHE", "")
    if setting == "0":
        return None
    root = Path(setting) if setting else cache_dir() / "gguf"
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    key.update(_converter_digest())
    out = root / f"{path.stem}-{key.hexdigest()[:16]}"
    if out.is_dir():  # a conversion appears whole (renamed into place)
        return out
    if 4 * sum(int(t.n_elements) for t in open_gguf(path).tensors) > MAX_CONVERTED_BYTES:
        return None
    try:
        _convert_gguf(path, out)
    except OSError as e:
        message = f"could not cache {path.name} in {root} ({e}); reading the GGUF file"
        warnings.warn(message, stacklevel=2)
        return None
    return out


@functools.cache
def _converter_digest() -> bytes:
    """The converting code's hash: read once a process (a model and its tokenizer both ask)."""
    sources = (Path(__file__).parent / name for name in _CONVERTER_SOURCES)
    return hashlib.sha256(b"".join(f.read_bytes() for f in sources)).digest()


def _convert_gguf(path: Path, out: Path) -> None:
    from specinfer.tokenizer import TokenizerWrapper

    out.parent.mkdir(parents=True, exist_ok=True)
    for partial in out.parent.glob(".*"):  # conversions left half-written by killed processes
        stale = time.time() - partial.stat().st_mtime > STALE_PARTIAL_S
        if stale and _PARTIAL.fullmatch(partial.name):
            shutil.rmtree(partial, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        config, tensors, total = _read_gguf(path)
        named = tqdm(tensors(), total=total, desc=f"converting {path.name}", unit="tensor")
        save_file({name: w.contiguous() for name, w in named}, tmp / _TENSORS)
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        TokenizerWrapper.save_gguf(path, tmp)
        for old in out.parent.glob(f"{glob.escape(path.stem)}-*"):
            if len(old.name) == len(out.name) and old != out:  # an earlier one of this name
                shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # else another process converted it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_converted(out: Path) -> tuple[ModelConfig, Callable[[], Iterator], int]:
    config = json.loads((out / "config.json").read_text())
    config["feature_layers"] = tuple(config["feature_layers"])
    with safe_open(out / _TENSORS, framework="pt") as st:
        names = list(st.keys())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(out / _TENSORS, framework="pt") as st:
            for name in names:
                yield name, st.get_tensor(name)

    return ModelConfig(**config), tensors, len(names)


def _gguf_to_hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP:
        return f"{GGUF_TOP[parts[0]]}.{parts[1]}"
    return None


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # The converter maps each head's rows (pairs-of-halves) to interleaved pairs:
    # reshape(h, 2, d/2, ...).swapaxes(1, 2). This is its inverse.
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def load_weights(
    model: nn.Module,
    named_tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    desc: str,
    preloaded: set[str] = frozenset(),
) -> None:
    """Hand each checkpoint tensor (HF name) to its parameter's weight_loader, then check that
    every parameter (every shard of a fused one) but those `preloaded` was loaded."""
    params = dict(model.named_parameters())
    loaded = defaultdict(set)
    for name, tensor in tqdm(named_tensors, total=total, desc=desc, unit="tensor"):
        target, shard_id = name, None
        for hf_part, (ours, sid) in model.packed_weights.items():
            if f".{hf_part}." in name:
                target, shard_id = name.replace(f".{hf_part}.", f".{ours}."), sid
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        if param.is_meta:  # another pipeline stage's
            continue
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded[target].add(shard_id)
    missing = []
    for name, p in params.items():
        expected = getattr(p, "shard_ids", {None})
        if loaded[name] != expected and name not in preloaded and not p.is_meta:
            shards = sorted(map(str, expected - loaded[name]))
            missing.append(f"{name} {shards}" if len(expected) > 1 else name)
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:10])}{more}")
