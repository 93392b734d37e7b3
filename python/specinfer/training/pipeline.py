"""`specinfer train-ssm` end to end: prompts -> teacher data -> SSM(s) -> export -> report.

<out>/teacher/, <out>/teacher_held_out/   the target's completions and top-K logits (shards)
<out>/checkpoint*.pt                      training state, while an SSM is being trained
<out>/ssm (or ssm_1..n, independent_1..n) exported SSMs (HF directories)
<out>/report.json                         agreement before/after training, boosting coverage
"""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import torch

from specinfer import ops
from specinfer.training.boosting import agreement, boost, independent
from specinfer.training.data import load_prompts, prompt_ids
from specinfer.training.distill import TrainSettings
from specinfer.training.evaluate import match_rule
from specinfer.training.recipe import SSMRecipe
from specinfer.training.student import parse_layers
from specinfer.training.teacher import TeacherSettings, head_tokens, make_teacher_data


def train_ssm(
    prompts: str | Path,
    out: str | Path,
    *,
    model: str | Path | None = None,
    layers: str = "first:2",
    mlp_keep: float = 1.0,
    held_out: str | Path | None = None,
    chat: bool | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k_logits: int = 32,
    dtype: str = "bfloat16",
    gen_batch: int = 16,
    settings: TrainSettings | None = None,
    compact: bool = False,
    boost_stages: int = 1,
    match: str = "identical",
    independent_mode: str | None = None,
    kind: str = "layers",
    start: str | Path | None = None,
    feature_layers: str | None = None,
    completions_from: str | Path | None = None,
) -> dict:
    """Returns the report (also written to <out>/report.json). `chat`: wrap text prompts in the
    target's chat template (default: when it has one, as `specinfer generate` does). `kind`:
    "layers" (a student of selected target layers) or "feature" (a feature-level draft head,
    see training/feature.py; `layers`, `mlp_keep`, boosting and `compact` do not apply; `start`:
    an SSM of the target the head starts from, e.g. the shipped default SSM, or a feature head
    to train further; `feature_layers`: target layers whose inputs it reads besides the final
    hidden state, EAGLE-3's low/middle/high fusion, e.g. "3,16,28"). `completions_from`: an
    earlier run's --out, made from the same prompts with the same generation settings: its
    teacher completions (and held-out ones, if it has them) are re-scored, not generated again
    (e.g. to read other feature layers)."""
    from specinfer.default_model import default_model_path
    from specinfer.engine import Engine
    from specinfer.loader import load_model

    settings = settings or TrainSettings()
    match_rule(match)  # bad input fails before any work
    if kind not in ("layers", "feature"):
        raise ValueError(f"kind must be 'layers' or 'feature', got {kind!r}")
    if start is not None and (kind != "feature" or not Path(start).is_dir()):
        raise ValueError(
            f"--start takes an SSM or feature head directory for --kind feature, got {start!r}"
        )
    if feature_layers and kind != "feature":
        raise ValueError("feature layers are read by a feature head: use them with --kind feature")
    if boost_stages < 1:
        raise ValueError(f"boost stages must be at least 1, got {boost_stages}")
    if top_k_logits < 1 or max_new_tokens < 1:
        raise ValueError("top-k-logits and max-new-tokens must be at least 1")
    if independent_mode not in (None, "split", "seeds"):
        raise ValueError(f"independent mode must be 'split' or 'seeds', got {independent_mode!r}")
    if completions_from is not None and _reused(completions_from, "teacher") is None:
        raise FileNotFoundError(f"no teacher data in {completions_from}: give an earlier run's "
                                "--out")  # fmt: skip
    out = Path(out)
    train_prompts = load_prompts(prompts)
    held_prompts = load_prompts(held_out) if held_out else []
    path = Path(model) if model is not None else default_model_path()
    engine = Engine(path, dtype=dtype, max_batch_size=gen_batch)
    chosen = parse_layers(layers, engine.config.num_layers)
    tapped = tuple(parse_layers(feature_layers, engine.config.num_layers)) if feature_layers else ()
    if chat is None:
        chat = bool(engine.tokenizer.chat_template)
    teacher = TeacherSettings(str(path), str(engine.dtype).removeprefix("torch."), max_new_tokens,
                              temperature, top_k_logits, chat,
                              features=kind == "feature",
                              feature_layers=list(tapped))  # fmt: skip
    # Soft targets and the student's starting weights come from float32, with the weights as
    # loaded (a student copies some; the engine's may be packed for its CPU kernel).
    reuse = engine.dtype == torch.float32 and not ops.panels_preferred(torch.float32)
    target = engine.model if reuse else load_model(path, torch.float32)
    if tapped:
        target.tap(tapped)  # the scorer hands their inputs over with its features
    examples = make_teacher_data(
        engine, target, _encode(engine, train_prompts, chat, prompts), teacher, out / "teacher",
        completions_from=_reused(completions_from, "teacher"),
    )  # fmt: skip
    # Held-out completions stay greedy whatever the training data's temperature: acceptance is
    # measured against the target's greedy choices, comparably across runs.
    held = make_teacher_data(
        engine, target, _encode(engine, held_prompts, chat, held_out),
        dataclasses.replace(teacher, temperature=0.0), out / "teacher_held_out",
        desc="held-out teacher data",
        completions_from=_reused(completions_from, "teacher_held_out"),
    ) if held_prompts else []  # fmt: skip
    tokenizer = engine.tokenizer
    del engine
    gc.collect()
    if kind == "feature":
        from specinfer.training.feature import train_feature_head

        return train_feature_head(target, tokenizer, examples, held, settings, out, str(path),
                                  start, tapped)  # fmt: skip

    recipe = SSMRecipe(target, tokenizer, chosen, settings, head_tokens(examples), mlp_keep,
                       compact)  # fmt: skip
    report = {"target": str(path), "layers": chosen, "mlp_keep": mlp_keep, "chat": chat,
              "train_prompts": len(examples), "held_out_prompts": len(held),
              "teacher_tokens": sum(len(e["completion"]) for e in examples)}  # fmt: skip
    if held:
        report["held_out_before"] = agreement(
            recipe.untrained(), held, "untrained: held-out agreement"
        )
    report["boosting"] = boost(recipe, examples, held, boost_stages, match, out)
    if independent_mode:
        report["independent"] = independent(
            recipe, examples, held, boost_stages, match, independent_mode, out
        )
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report))
    return report


def _reused(run: str | Path | None, name: str) -> Path | None:
    """An earlier run's teacher data directory `name`, if there is one."""
    return Path(run) / name if run is not None and (Path(run) / name).is_dir() else None


def _encode(engine, prompts: list, chat: bool, file) -> list[list[int]]:
    ids = [prompt_ids(engine.tokenizer, p, chat) for p in prompts]
    limit = engine.config.max_position_embeddings
    for n, x in enumerate(ids, 1):
        if not 0 < len(x) < limit:
            raise ValueError(
                f"{file}: prompt {n} has {len(x)} tokens; the target's context is {limit}"
            )
    return ids


def summary(report: dict) -> str:
    """A few lines for the terminal."""
    lines = [f"layers {report['layers']}, {report['train_prompts']} prompts, "
             f"{report['teacher_tokens']} teacher tokens"]  # fmt: skip

    def agree(a):
        return " ".join(f"{k} {v:.1%}" for k, v in a.items())

    if "held_out_before" in report:
        lines.append(f"held-out agreement before training: {agree(report['held_out_before'])}")
    for kind in ("boosting", "independent"):
        for s in report.get(kind, {}).get("ssms", []):
            line = f"{kind} {s['ssm']}: trained on {s['trained_on']}, coverage {s['coverage']:.1%}"
            if "held_out_agreement" in s:
                line += (f", held-out coverage {s['held_out_coverage']:.1%}, "
                         f"agreement {agree(s['held_out_agreement'])}")  # fmt: skip
            lines.append(line)
    return "\n".join(lines)
