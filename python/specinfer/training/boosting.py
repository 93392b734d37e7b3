"""Adaptive boosting of SSMs (SpecInfer, section 3) and independent training to compare with.

Boosting: SSM_1 learns all prompts; the prompts it covers (its greedy output matches the
target's, by `match_rule`) are removed; SSM_2 learns the rest; and so on. Independent: the same
number of SSMs, each on a random equal share of the prompts (or each on all, with its own seed).
Coverage: the fraction of prompts some SSM of the set covers, on the training prompts and on
held-out ones (what a merged tree of the set can hope to accept whole).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specinfer.training.evaluate import agreement_vectors, match_rule, topk_agreement
from specinfer.training.recipe import SSMRecipe


def boost(recipe: SSMRecipe, examples: list[dict], held_out: list[dict], n: int, rule: str,
          out: Path) -> dict:  # fmt: skip
    """Train up to n SSMs (fewer if every prompt gets covered): <out>/ssm (n = 1) or
    <out>/ssm_1 .. ssm_n. Returns the report: per stage, what it trained on and what it covers."""
    match = match_rule(rule)
    remaining = list(range(len(examples)))
    held_covered = [False] * len(held_out)
    stages = []
    for i in range(1, n + 1):
        if not remaining:
            break
        name = "ssm" if n == 1 else f"ssm_{i}"
        checkpoint = out / ("checkpoint.pt" if n == 1 else f"checkpoint_{name}.pt")
        train = [examples[j] for j in remaining]
        # Its own seed: a stage that covered nothing does not hand the next the same run.
        ssm = recipe.train(train, out / name, checkpoint, seed=i - 1)
        matched = covers(ssm, train, match, f"{name}: coverage")
        remaining = [j for j, m in zip(remaining, matched) if not m]
        stage = {"ssm": name, "trained_on": len(train), "covered": sum(matched),
                 "coverage": 1 - len(remaining) / len(examples)}  # fmt: skip
        if held_out:
            report, held_covered = held_out_report(ssm, name, held_out, held_covered, match)
            stage.update(report)
        stages.append(stage)
    return {"rule": rule, "ssms": stages}


def independent(recipe: SSMRecipe, examples: list[dict], held_out: list[dict], n: int, rule: str,
                mode: str, out: Path) -> dict:  # fmt: skip
    """n SSMs <out>/independent_1..n, each on a random 1/n of the prompts ("split") or on all
    of them with seed i ("seeds"); returns the coverage of the set."""
    if mode not in ("split", "seeds"):
        raise ValueError(f"independent training mode must be 'split' or 'seeds', got {mode!r}")
    match = match_rule(rule)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0)).tolist()
    covered, held_covered, ssms = [False] * len(examples), [False] * len(held_out), []
    for i in range(1, n + 1):
        part = examples if mode == "seeds" else [examples[j] for j in order[i - 1 :: n]]
        name = f"independent_{i}"
        ssm = recipe.train(part, out / name, out / f"checkpoint_{name}.pt", seed=i - 1)
        covered = [
            a or b for a, b in zip(covered, covers(ssm, examples, match, f"{name}: coverage"))
        ]
        entry = {"ssm": name, "trained_on": len(part), "coverage": sum(covered) / len(examples)}
        if held_out:
            report, held_covered = held_out_report(ssm, name, held_out, held_covered, match)
            entry.update(report)
        ssms.append(entry)
    return {"rule": rule, "mode": mode, "ssms": ssms}


def held_out_report(ssm: nn.Module, name: str, held_out: list[dict], held_covered: list[bool],
                    match) -> tuple[dict, list[bool]]:  # fmt: skip
    """The set's held-out coverage once this SSM joins it and this SSM's top-1/3/5 agreement
    on the held-out prompts; and the held-out prompts the set now covers."""
    hits = covers(ssm, held_out, match, f"{name}: held-out coverage")
    covered = [a or b for a, b in zip(held_covered, hits)]
    top_k = agreement(ssm, held_out, f"{name}: held-out agreement")
    return {"held_out_coverage": sum(covered) / len(held_out), "held_out_agreement": top_k}, covered


def covers(ssm: nn.Module, examples: list[dict], match, desc: str | None = None) -> list[bool]:
    return [match(a) for a in agreement_vectors(ssm, sequences(examples), desc)]


def agreement(ssm: nn.Module, examples: list[dict], desc: str | None = None) -> dict[str, float]:
    """Top-1/3/5 agreement with the target's top token (stored with the teacher data)."""
    wanted = ({"greedy": e["topk_ids"][:, 0]} for e in examples)
    return topk_agreement(ssm, sequences(examples), wanted, desc)["greedy"]


def sequences(examples: list[dict]) -> list[tuple[list[int], list[int]]]:
    return [(e["prompt"], e["completion"]) for e in examples]
