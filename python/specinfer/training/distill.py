"""Distillation: train the student's layers and final norm on the teacher's data.

Loss only at completion positions: "kl" against the teacher's top-K distribution (renormalised
over those K tokens), or "ce" on the teacher's tokens. Logits are computed only at those
positions, and optionally over a vocabulary subset (the most frequent tokens plus every token the
batch's teacher ranks in its top K): the LM head (vocab x hidden) costs more than two layers.
Checkpoints go to one file, atomically; a re-run with the same file resumes; Ctrl-C finishes
the current step, saves, and stops.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from specinfer.training.student import train_forward
from specinfer.training.teacher import head_tokens


@dataclass
class TrainSettings:
    loss: str = "kl"  # "kl" (soft targets) or "ce" (teacher tokens)
    epochs: float = 2.0
    steps: int | None = None  # overrides epochs
    lr: float = 3e-4
    batch_size: int = 8
    warmup: float = 0.05  # fraction of steps
    weight_decay: float = 0.0
    checkpoint_every: int = 50
    seed: int = 0
    loss_vocab: int = 0  # > 0: logits over the N most frequent teacher tokens + each batch's top K

    def __post_init__(self):
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss must be 'kl' or 'ce', got {self.loss!r}")
        if self.batch_size < 1 or self.checkpoint_every < 1:
            raise ValueError("batch_size and checkpoint_every must be at least 1")
        if self.loss_vocab < 0:
            raise ValueError(
                f"loss_vocab must be >= 0 (0 = the whole vocabulary), got {self.loss_vocab}"
            )
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError("epochs and lr must be positive")


def distill(
    student: nn.Module,
    examples: list[dict],
    settings: TrainSettings,
    checkpoint: str | Path,
    desc: str = "distilling",
    loss_fn=None,
) -> list[float]:
    """Train `student` in place; returns the loss of every step (resumed steps included).
    `loss_fn(student, batch, settings.loss, vocab_subset) -> (loss, top-1 agreement)`: default
    the SSM distillation loss below."""
    checkpoint = Path(checkpoint)
    if not examples:
        raise ValueError("no training examples")
    trainable = {n: p for n, p in student.named_parameters()
                 if not n.startswith(("model.embed_tokens", "lm_head"))}  # fmt: skip
    for p in trainable.values():
        p.requires_grad_(True)
    vocab_subset = None
    if settings.loss_vocab > 0:
        vocab_subset = torch.tensor(sorted(head_tokens(examples)[: settings.loss_vocab]))
    batches_per_epoch = math.ceil(len(examples) / settings.batch_size)
    total = settings.steps or math.ceil(settings.epochs * batches_per_epoch)
    optimizer = torch.optim.AdamW(
        trainable.values(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    warmup = max(1, round(settings.warmup * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))),
    )
    step, losses = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        same_run = _run_identity(state["settings"]) == _run_identity(asdict(settings))
        if not same_run or state["num_examples"] != len(examples):
            raise ValueError(
                f"{checkpoint} is from a run with other settings or data; use another --out "
                "directory or delete it"
            )
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(state["student"][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step, losses = state["step"], state["losses"]
        tqdm.write(f"resuming from {checkpoint} at step {step}/{total}", file=sys.stderr)

    def save():
        state = {"step": step, "losses": losses, "settings": asdict(settings),
                 "num_examples": len(examples), "rng": torch.get_rng_state(),
                 "student": {n: p.detach() for n, p in trainable.items()},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}  # fmt: skip
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(checkpoint)

    student.train()
    bar = tqdm(total=total, initial=step, desc=desc, unit="step")
    order = {}  # epoch -> its batches
    with _deferred_sigint() as stop:
        while step < total:
            epoch, index = divmod(step, batches_per_epoch)
            if epoch not in order:
                order = {epoch: _batches(examples, settings, epoch)}
            batch = [examples[i] for i in order[epoch][index]]
            loss, agree = (loss_fn or _loss)(student, batch, settings.loss, vocab_subset)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable.values(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{agree:.2f}")
            if step % settings.checkpoint_every == 0 or step == total or stop.is_set():
                save()
            if stop.is_set():
                bar.close()
                raise KeyboardInterrupt(f"stopped at step {step}/{total}; checkpoint saved")
    bar.close()
    student.eval()
    for p in trainable.values():
        p.requires_grad_(False)
    return losses


def _run_identity(settings: dict) -> dict:
    """The settings a checkpoint must share with the run that resumes it."""
    return {k: v for k, v in settings.items() if k != "checkpoint_every"}


def _batches(examples: list[dict], settings: TrainSettings, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s mini-batches (example indices), the same on every run: shuffled, with
    pools of 16 batches sorted by length so that a batch pads little."""
    g = torch.Generator().manual_seed(settings.seed * 100_003 + epoch)
    order = torch.randperm(len(examples), generator=g).tolist()
    size, pool = settings.batch_size, settings.batch_size * 16
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: _input_len(examples[i]))
        batches += [chunk[j : j + size] for j in range(0, len(chunk), size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def _input_len(example: dict) -> int:
    return len(example["prompt"]) + len(example["completion"]) - 1


def _loss(student: nn.Module, batch: list[dict], kind: str, vocab_subset: torch.Tensor | None):
    """Mean loss over the batch's completion positions, and the fraction of them where the
    student's top token is the teacher's."""
    T = max(_input_len(e) for e in batch)
    ids = torch.tensor([(e["prompt"] + e["completion"][:-1]) + [0] * (T - _input_len(e))
                        for e in batch])  # fmt: skip
    rows = torch.cat([torch.full((len(e["completion"]),), b) for b, e in enumerate(batch)])
    cols = torch.cat([torch.arange(len(e["completion"])) + len(e["prompt"]) - 1 for e in batch])
    hidden = train_forward(student, ids)[rows, cols]
    teacher_ids = torch.cat([e["topk_ids"] for e in batch]).long()
    tokens = torch.tensor([t for e in batch for t in e["completion"]])
    head = student.lm_head.weight
    if vocab_subset is not None:
        # Sorted, so searchsorted maps vocabulary ids to subset columns.
        keep = torch.unique(torch.cat([vocab_subset, teacher_ids.flatten(), tokens]))
        head = head[keep]
        teacher_ids = torch.searchsorted(keep, teacher_ids)
        tokens = torch.searchsorted(keep, tokens)
    log_q = F.log_softmax(hidden @ head.T, dim=-1)
    agree = (log_q.argmax(-1) == teacher_ids[:, 0]).float().mean().item()
    if kind == "ce":
        return F.nll_loss(log_q, tokens), agree
    log_p = F.log_softmax(torch.cat([e["topk_logits"] for e in batch]).float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q.gather(1, teacher_ids))).sum(-1)
    return kl.mean(), agree


class _deferred_sigint:
    """Within the block, Ctrl-C sets the event (the loop saves and stops after the current
    step); a second Ctrl-C interrupts at once."""

    def __enter__(self) -> threading.Event:
        self.event = threading.Event()
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self.event

    def _handle(self, signum, frame):
        if self.event.is_set():
            raise KeyboardInterrupt
        tqdm.write(
            "interrupted: finishing this step and saving a checkpoint (Ctrl-C again to abort)",
            file=sys.stderr,
        )
        self.event.set()

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False
