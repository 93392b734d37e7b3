"""Teacher data: the target's own completions and its top-K logits at every completion position.

Work is saved in shards (`<dir>/shard_00000.pt`, ...) as it finishes, so an interrupted run
resumes at the first missing shard. `<dir>/meta.json` records the settings; a re-run with other
settings (or other prompts) stops with an error instead of mixing data.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.training.scoring import completion_outputs


@dataclass
class TeacherSettings:
    model: str
    dtype: str = "bfloat16"  # of the generating engine (soft targets: the float32 scorer)
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy completions
    top_k_logits: int = 32
    chat: bool = True
    seed: int = 0
    shard_size: int = 32
    features: bool = False  # also keep the target's hidden states (for a feature-level head)
    # and the inputs of these target layers before them (the scorer taps them)
    feature_layers: list[int] = field(default_factory=list)


# What makes the completions themselves: data with these equal can share them.
GENERATION = ("model", "dtype", "max_new_tokens", "temperature", "chat", "seed", "shard_size",
              "prompts_sha256", "num_prompts")  # fmt: skip


def make_teacher_data(
    engine, scorer, prompts: list[list[int]], settings: TeacherSettings, out_dir: str | Path,
    desc: str = "teacher data", completions_from: str | Path | None = None,
) -> list[dict]:  # fmt: skip
    """Examples {"prompt", "completion" (token id lists), "topk_ids" int32 [n, K],
    "topk_logits" float16 [n, K]}, with settings.features also "features" float16 [len(prompt) +
    n - 1, F] (the scorer's features at every input position: its final hidden state, after the
    inputs of the layers it taps), for every prompt (token ids), in order. The engine writes the
    completions (in the dtype it will serve in); `scorer`, the same model in float32, gives the
    logits (a teacher-forced forward, where torch's float32 matmul is fast on the CPU).
    `completions_from`: a teacher data directory made from the same prompts with the same
    generation settings: its completions are re-scored here instead of generated again (for
    other features or top-K logits)."""
    from specinfer.sampling import SamplingParams

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**asdict(settings), "prompts_sha256": _digest(prompts), "num_prompts": len(prompts)}
    meta_file = out_dir / "meta.json"
    if meta_file.exists():
        changed = _changed(meta_file, meta)
        if changed:
            raise ValueError(
                f"teacher data in {out_dir} was made with other settings ({', '.join(changed)} "
                f"differ); use another --out directory or delete {out_dir}"
            )
    if completions_from is not None:
        completions_from = Path(completions_from)
        source = completions_from / "meta.json"
        if not source.exists():
            raise FileNotFoundError(f"no teacher data in {completions_from} (no meta.json)")
        changed = _changed(source, meta, GENERATION)
        if changed:
            raise ValueError(f"the completions in {completions_from} were generated otherwise "
                             f"({', '.join(changed)} differ): they cannot be reused here")  # fmt: skip
    if not meta_file.exists():
        meta_file.write_text(json.dumps(meta, indent=1))
    examples: list[dict] = []
    size = settings.shard_size
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for index, start in enumerate(range(0, len(prompts), size)):
        file = out_dir / f"shard_{index:05d}.pt"
        if file.exists():
            shard = torch.load(file, weights_only=True)
        else:
            chunk = prompts[start : start + size]
            if completions_from is not None:
                seqs = _stored_completions(completions_from / file.name, chunk)
            else:
                params = [
                    SamplingParams(max_tokens=settings.max_new_tokens,
                                   temperature=settings.temperature,
                                   seed=settings.seed + start + i)
                    for i in range(len(chunk))
                ]  # fmt: skip
                seqs = [(p, o.token_ids) for p, o in zip(chunk, engine.generate(chunk, params))]
            shard = [
                _example(p, c, logits, settings.top_k_logits, hidden if settings.features else None)
                for (p, c), (logits, hidden) in zip(seqs, completion_outputs(scorer, seqs))
            ]
            tmp = file.with_suffix(".tmp")
            torch.save(shard, tmp)
            tmp.replace(file)  # a shard is on disk whole or not at all
        examples += shard
        bar.update(len(shard))
        bar.set_postfix(tokens=sum(len(e["completion"]) for e in examples))
    bar.close()
    return examples


def _changed(meta_file: Path, meta: dict, keys=None) -> list[str]:
    """The settings (among `keys`, default all) that `meta_file` records otherwise than `meta`;
    settings added since that data was made read as their defaults."""
    defaults = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                for f in fields(TeacherSettings)}  # fmt: skip
    old = {**defaults, **json.loads(meta_file.read_text())}
    return sorted(k for k in keys or old.keys() | meta.keys() if old.get(k) != meta.get(k))


def _stored_completions(file: Path, prompts: list[list[int]]) -> list[tuple[list, list]]:
    if not file.exists():
        raise FileNotFoundError(f"{file.parent} lacks {file.name}: finish the run that makes it "
                                "first")  # fmt: skip
    seqs = [(e["prompt"], e["completion"]) for e in torch.load(file, weights_only=True)]
    if [p for p, _ in seqs] != prompts:
        raise ValueError(f"{file} holds completions of other prompts")
    return seqs


def _example(prompt: list[int], completion: list[int], logits: torch.Tensor, k: int,
             hidden: torch.Tensor | None) -> dict:  # fmt: skip
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    example = {
        "prompt": prompt,
        "completion": completion,
        "topk_ids": top.indices.to(torch.int32),
        "topk_logits": top.values.to(torch.float16),
    }
    if hidden is not None:
        example["features"] = hidden.to(torch.float16).clone()  # not a view of the batch
    return example


def _digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def head_tokens(examples: list[dict]) -> list[int]:
    """Every token id seen in the examples, most frequent in completions first, ties (and
    prompt-only tokens) by frequency in prompts."""
    completions = Counter(t for e in examples for t in e["completion"])
    prompts = Counter(t for e in examples for t in e["prompt"])
    return sorted(
        completions.keys() | prompts.keys(), key=lambda t: (-completions[t], -prompts[t], t)
    )
