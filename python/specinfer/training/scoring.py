"""Teacher-forced logits of a model at the completion positions of prompt + completion sequences.

One causal forward per mini-batch of right-padded sequences, with our inference kernels: this is
how the teacher's soft targets are made and how an SSM is scored against the target.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from specinfer.models.feature_head import target_features

Sequence = tuple[list[int], list[int]]  # (prompt ids, completion ids)


def completion_logits(
    model: nn.Module, seqs: list[Sequence], batch_size: int = 8, desc: str | None = None
) -> Iterator[torch.Tensor]:
    """Yields, per sequence, float32 logits [len(completion), vocab]: row j predicts
    completion[j] from the prompt and completion[:j]. `desc`: show a progress bar with it."""
    for logits, _ in completion_outputs(model, seqs, batch_size, desc):
        yield logits


@torch.inference_mode()
def completion_outputs(
    model: nn.Module, seqs: list[Sequence], batch_size: int = 8, desc: str | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the completion logits (as completion_logits) and the model's features
    [len(prompt) + len(completion) - 1, F] at every input position (what a feature-level draft
    head reads: the final hidden states, after the inputs of the layers the model taps, if any;
    see LlamaForCausalLM.tap)."""
    with tqdm(total=len(seqs), desc=desc, unit="prompt", disable=desc is None, leave=False) as bar:
        for start in range(0, len(seqs), batch_size):
            batch = seqs[start : start + batch_size]
            inputs = [p + c[:-1] for p, c in batch]
            T = max(len(x) for x in inputs)
            ids = torch.tensor(
                [x + [0] * (T - len(x)) for x in inputs]
            )  # padding sits after, unseen
            B = len(batch)
            kv = model.make_kv_cache(B, T)
            mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
            hidden = model(ids, torch.arange(T).expand(B, T), kv, torch.arange(B),
                           torch.zeros(B, dtype=torch.long), mask)  # fmt: skip
            features = target_features(hidden, model.taps() if hasattr(model, "taps") else [])
            for b, (p, c) in enumerate(batch):
                logits = model.compute_logits(hidden[b, len(p) - 1 : len(p) - 1 + len(c)]).float()
                yield logits, features[b, : len(p) + len(c) - 1]
            bar.update(B)
