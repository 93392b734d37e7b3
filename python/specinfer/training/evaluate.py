"""How well an SSM agrees with its target, teacher-forced on the target's own completions.

- `topk_agreement`: Table 1 of the paper: how often the target's next token is in the SSM's
  top-1/3/5 (greedy: the target's top token; stochastic: a token sampled from the target).
- `agreement_vectors` + `match_rule`: per prompt, which completion positions the SSM's top token
  gets right; a rule turns that into "this SSM covers the prompt" (adaptive boosting). One SSM
  forward per prompt: when every position agrees, the SSM's own greedy output is the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from specinfer.training.scoring import Sequence, completion_logits

KS = (1, 3, 5)


def topk_agreement(
    ssm: nn.Module,
    seqs: list[Sequence],
    wanted: Iterable[dict[str, torch.Tensor]],
    desc: str | None = None,
) -> dict[str, dict[str, float]]:
    """`wanted` yields, per sequence, named target tokens per completion position (e.g.
    {"greedy": ...} from stored teacher data, or `target_tokens`); returns, per name, the
    fraction of positions where that token is in the SSM's top k. `desc`: a progress bar."""
    hits: dict[str, list[int]] = {}
    total = 0
    for ssm_logits, want in zip(completion_logits(ssm, seqs, desc=desc), wanted):
        top = ssm_logits.topk(max(KS), dim=-1).indices
        for name, tokens in want.items():
            counts = hits.setdefault(name, [0] * len(KS))
            for i, k in enumerate(KS):
                counts[i] += (top[:, :k] == tokens.long()[:, None]).any(-1).sum().item()
        total += len(top)
    return {name: {f"top{k}": h[i] / total for i, k in enumerate(KS)} for name, h in hits.items()}


def target_tokens(
    target: nn.Module, seqs: list[Sequence], seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """The target's top token ("greedy") and one sampled at temperature 1 ("stochastic") at
    every completion position."""
    gen = torch.Generator().manual_seed(seed)
    for logits in completion_logits(target, seqs):
        sampled = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
        yield {"greedy": logits.argmax(-1), "stochastic": sampled}


def agreement_vectors(
    ssm: nn.Module, seqs: list[Sequence], desc: str | None = None
) -> list[torch.Tensor]:
    """Per sequence, a bool per completion position: is the SSM's top token the completion's?"""
    return [
        logits.argmax(-1) == torch.tensor(completion)
        for (_, completion), logits in zip(seqs, completion_logits(ssm, seqs, desc=desc))
    ]


def match_rule(rule: str) -> Callable[[torch.Tensor], bool]:
    """ "identical" (the SSM's greedy output is the whole completion, as in the paper),
    "prefix:N" (its first N tokens), or "agree:X" (at least a fraction X of positions agree)."""
    kind, _, arg = rule.partition(":")
    try:
        if kind == "identical" and not arg:
            return lambda agree: bool(agree.all())
        if kind == "prefix":
            n = int(arg)
            if n >= 1:
                return lambda agree: bool(agree[:n].all())
        if kind == "agree":
            x = float(arg)
            if 0 < x <= 1:
                return lambda agree: agree.float().mean().item() >= x
    except ValueError:
        pass
    raise ValueError(
        f"match rule must be identical, prefix:N (N >= 1) or agree:X (0 < X <= 1); got {rule!r}"
    )
