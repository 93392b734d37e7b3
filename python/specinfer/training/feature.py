"""Training a feature head (models/feature_head.py) on the target's own hidden states.

Teacher data with `features` (teacher.py) gives the target's final hidden state f_s at every
input slot s. The head reads (f_{s-1}, token s) and is trained to give f_s back (smooth L1) and,
through the target's LM head, the target's next-token distribution softmax(head(f_s)) (KL): the
exact distribution at every slot, prompt slots included, with no logits stored.

Drafting deeper feeds the head its own outputs, so training unrolls it as drafting does (EAGLE-3's
"training-time test"): pass j reads at slot s the output of pass j-1 at slot s-1, and attends to
what a depth-j draft node sees, the true entries up to slot s-j and its own draft ancestors
(pass i at slot s-j+i). Pass j's top token at s being the target's is acceptance at depth j+1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from specinfer.models.feature_head import FeatureHead
from specinfer.training.distill import TrainSettings, distill
from specinfer.training.export import export_student
from specinfer.training.scoring import completion_logits
from specinfer.training.student import _rms_norm, train_layer

UNROLL = 3  # passes trained (and depths evaluated)
# Smooth L1 on features, beside the KL on tokens (weight 1): a light anchor. The unrolled
# passes already train what depth 2+ reads (EAGLE-3 drops this loss altogether).
FEATURE_WEIGHT = 0.1


def build_head(target: nn.Module, start: nn.Module | None = None,
               feature_layers: tuple[int, ...] = ()) -> FeatureHead:  # fmt: skip
    """A float32 head for `target`, sharing its embedding and LM head.
    - From `start`, a feature head of the target: a copy of it, to train further (e.g. on new
      data).
    - From `start`, an SSM of the target (e.g. the distilled default SSM): its layers and norm,
      with fc passing the token embedding through and ignoring the feature, so the head starts
      as that SSM and training adds what the features tell.
    - Without it: one layer, the target's last (it already maps hidden states to features), its
      final norm, and fc passing the feature through plus a little of the token.
    With `feature_layers` it also reads the inputs of those target layers (EAGLE-3's fusion);
    its `fc_layers` starts reading the final hidden state alone (or as `start`'s, if that reads
    the same layers), so the head starts as it would without them.
    """
    if target.config.architecture != "llama":
        raise ValueError(f"feature heads support Llama-family targets, not "
                         f"{target.config.architecture}")  # fmt: skip
    source = start if start is not None else target
    layers = list(source.model.layers) if start is not None else [target.model.layers[-1]]
    n = target.config.num_layers
    if not all(0 <= i < n for i in feature_layers):
        raise ValueError(f"feature layers {list(feature_layers)}: the target has layers 0..{n - 1}")
    config = dataclasses.replace(source.config, architecture="feature", num_layers=len(layers),
                                 feature_layers=tuple(feature_layers))  # fmt: skip
    head = FeatureHead(config).float().eval()
    for mine, theirs in zip(head.model.layers, layers):
        mine.load_state_dict(theirs.state_dict())
    head.model.norm.load_state_dict(source.model.norm.state_dict())
    H = config.hidden_size
    with torch.no_grad():
        if start is not None and start.config.architecture == "feature":
            head.fc.load_state_dict(start.fc.state_dict())
        elif start is not None:
            head.fc.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))
            head.fc.bias.zero_()
        else:
            g = torch.Generator().manual_seed(0)
            token = torch.randn(H, H, generator=g) * 0.16 / math.sqrt(H)
            head.fc.weight.copy_(torch.cat([token, torch.eye(H)], dim=1))
            head.fc.bias.zero_()
        if feature_layers:
            same = (
                start is not None
                and start.config.architecture == "feature"
                and start.config.feature_layers == config.feature_layers
            )
            if same:
                head.fc_layers.load_state_dict(start.fc_layers.state_dict())
            else:
                head.fc_layers.weight.zero_()
                head.fc_layers.weight[:, -H:] = torch.eye(H)
                head.fc_layers.bias.zero_()
    head.model.embed_tokens.weight = target.model.embed_tokens.weight
    head.lm_head.weight = target.lm_head.weight
    return head


def unrolled_forward(head: FeatureHead, ids: torch.Tensor, features: torch.Tensor,
                     passes: int = UNROLL) -> list[torch.Tensor]:  # fmt: skip
    """Each pass's outputs [B, T, H] over right-padded ids [B, T] from slot 0; features[b, s] is
    the target's f_s (with the layers the head reads: [B, T, F]). Differentiable torch ops, same
    math as serving (see the module doc)."""
    if head.config.feature_layers:
        features = F.linear(features, head.fc_layers.weight, head.fc_layers.bias)
    B, T, H = features.shape
    before = torch.cat([features.new_zeros(B, 1, H), features[:, :-1]], dim=1)
    embedded = F.embedding(ids, head.model.embed_tokens.weight)
    outs, past = [], [[] for _ in head.model.layers]  # per layer: (k, v) of each pass
    for j in range(passes):
        h = F.linear(torch.cat([embedded, before], -1), head.fc.weight, head.fc.bias)
        # Pass j's token at slot s sits at depth j below a root at s - j: RoPE position s.
        for layer, kv in zip(head.model.layers, past):
            h = train_layer(head, layer, h, _draft_attention(kv, j))
        out = _rms_norm(h, head.model.norm)
        outs.append(out)
        before = torch.cat([out.new_zeros(B, 1, H), out[:, :-1]], dim=1)
    return outs


def _draft_attention(past: list, j: int):
    """Pass j's attention (see the module doc); `past` collects each pass's keys and values."""

    def attend(q, k, v):
        past.append((k, v))
        T, group = q.shape[1], q.shape[2] // k.shape[2]
        q = q.transpose(1, 2) / math.sqrt(q.shape[-1])  # [B, Hq, T, D]
        k0, v0 = (t.repeat_interleave(group, 2).transpose(1, 2) for t in past[0])
        s = torch.arange(T)
        scores = [(q @ k0.transpose(-1, -2)).masked_fill(s[None, :] > s[:, None] - j, -math.inf)]
        values = []
        for i in range(1, j + 1):  # the draft ancestors: pass i at slot s - j + i
            ki, vi = (_shift(t, j - i).repeat_interleave(group, 2).transpose(1, 2)
                      for t in past[i])  # fmt: skip
            scores.append(
                (q * ki).sum(-1, keepdim=True).masked_fill((s < j - i)[:, None], -math.inf)
            )
            values.append(vi)
        p = torch.softmax(torch.cat(scores, -1), -1)
        out = p[..., :T] @ v0
        for i, vi in enumerate(values):
            out = out + p[..., T + i : T + i + 1] * vi
        return out.transpose(1, 2)

    return attend


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [B, T, ...] moved n slots later (slot s holds t[s - n]; the first n are zeros)."""
    return t if n == 0 else torch.cat([t.new_zeros(t.shape[0], n, *t.shape[2:]), t[:, :-n]], 1)


def feature_loss(head: FeatureHead, batch: list[dict], kind: str, vocab: torch.Tensor | None):
    """distill's loss for a head: per unrolled pass, smooth L1 to the target's features and
    KL from the target's next-token distribution (over `vocab` and the batch's tokens, or the
    whole vocabulary); and how often pass 0's top token is the target's."""
    ids, feats, valid = _batch(batch)
    weight = head.lm_head.weight
    if vocab is not None:
        weight = weight[torch.unique(torch.cat([vocab, ids[valid]]))]
    want = feats[valid][:, -head.config.hidden_size :]  # the final hidden states
    with torch.no_grad():
        log_p = F.log_softmax(want @ weight.T, -1)
    slot = torch.arange(ids.shape[1]).expand_as(ids)[valid]
    total, agree = 0.0, 0.0
    for j, out in enumerate(unrolled_forward(head, ids, feats)):
        keep = slot >= j  # pass j's first j slots have no draft root
        got = out[valid][keep]
        log_q = F.log_softmax(got @ weight.T, -1)
        kl = (log_p[keep].exp() * (log_p[keep] - log_q)).sum(-1).mean()
        total = total + kl + FEATURE_WEIGHT * F.smooth_l1_loss(got, want[keep])
        if j == 0:
            agree = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean().item()
    return total / UNROLL, agree


def _batch(batch: list[dict]):
    """Right-padded input ids [B, T], the target's features there (float32) and a validity mask."""
    T = max(len(e["features"]) for e in batch)
    H = batch[0]["features"].shape[1]
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    feats = torch.zeros(len(batch), T, H)
    valid = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, e in enumerate(batch):
        n = len(e["features"])
        ids[b, :n] = torch.tensor(e["prompt"] + e["completion"][:-1])
        feats[b, :n] = e["features"].float()
        valid[b, :n] = True
    return ids, feats, valid


@torch.no_grad()
def draft_logits(head: FeatureHead, examples: list[dict], batch_size: int = 8,
                 desc: str | None = None):  # fmt: skip
    """Per example, teacher-forced on its completion: each unrolled pass's logits [C, V] at the
    completion slots (pass d at completion index c guesses completion[c], from d guessed
    features before it)."""
    for start in tqdm(range(0, len(examples), batch_size), desc=desc, disable=desc is None,
                      leave=False):  # fmt: skip
        batch = examples[start : start + batch_size]
        ids, feats, _ = _batch(batch)
        outs = unrolled_forward(head, ids, feats)
        for b, e in enumerate(batch):
            P, C = len(e["prompt"]), len(e["completion"])
            yield [head.compute_logits(out[b, P - 1 : P - 1 + C]) for out in outs]


def chain_acceptance(head: FeatureHead, examples: list[dict], batch_size: int = 8,
                     desc: str | None = None) -> dict[str, float]:  # fmt: skip
    """Teacher-forced on the target's completions: from each completion slot, the fraction of
    drafts whose first d tokens (the head's top token at each depth, after the true tokens)
    are all the target's, d = 1..UNROLL ("depth1".. keys; their sum is the expected number of
    tokens a chain of UNROLL gets accepted)."""
    matches = [[logits.argmax(-1) == torch.tensor(e["completion"]) for logits in per_pass]
               for e, per_pass in zip(examples, draft_logits(head, examples, batch_size, desc))]  # fmt: skip
    return chain_rates(matches)


def ssm_chain_acceptance(ssm: nn.Module, examples: list[dict]) -> dict[str, float]:
    """The same for an SSM drafting on tokens alone (its context is the same at every depth)."""
    seqs = [(e["prompt"], e["completion"]) for e in examples]
    return chain_rates([[logits.argmax(-1) == torch.tensor(c)] * UNROLL
                        for (_, c), logits in zip(seqs, completion_logits(ssm, seqs))])  # fmt: skip


def chain_rates(matches: list[list[torch.Tensor]]) -> dict[str, float]:
    """matches[example][d][c]: depth d+1's guess right for a draft rooted before completion[c-d]."""
    hits, total = [0] * UNROLL, 0
    for per_depth in matches:
        C = len(per_depth[0])
        ok = torch.ones(C, dtype=torch.bool)
        for d, m in enumerate(per_depth):
            # A draft rooted before completion[r] is right at depth d+1 if m[r + d] is.
            shifted = torch.zeros(C, dtype=torch.bool)
            shifted[: C - d] = m[d:]
            ok &= shifted
            hits[d] += int(ok.sum())
        total += C
    return {f"depth{d + 1}": h / max(total, 1) for d, h in enumerate(hits)}


def train_feature_head(target, tokenizer, examples: list[dict], held: list[dict],
                       settings: TrainSettings, out: Path, target_name: str,
                       start: str | Path | None = None,
                       feature_layers: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """The pipeline's `--kind feature`: build (from the SSM at `start`, reading `feature_layers`,
    see build_head), train (resumable), export to <out>/feature (or load a finished export), and
    report held-out chain acceptance before and after."""
    from specinfer.default_model import DEFAULT_SSM_DIR, ships_an_ssm
    from specinfer.loader import load_model
    from specinfer.training.teacher import head_tokens

    if examples and "features" not in examples[0]:
        raise ValueError("teacher data without features: remake it with --kind feature")
    ssm = None
    if start is not None:
        ssm = load_model(start, torch.float32, shared_embeddings_from=target)
    head = build_head(target, ssm, feature_layers)
    width = head.feature_size
    for e in examples + held:
        if e["features"].shape[-1] != width:
            raise ValueError(f"teacher data with features {e['features'].shape[-1]} wide; a head "
                             f"reading layers {list(feature_layers)} needs {width}")  # fmt: skip
    out_dir = out / "feature"
    info = {"kind": "feature", "train": asdict(settings), "examples": len(examples),
            "unroll": UNROLL, "feature_weight": FEATURE_WEIGHT,
            "start": str(start) if start is not None else None}  # fmt: skip
    if feature_layers:
        info["feature_layers"] = list(feature_layers)
    report = {"target": target_name, "kind": "feature", "train_prompts": len(examples),
              "held_out_prompts": len(held),
              "teacher_tokens": sum(len(e["completion"]) for e in examples),
              # the loss reads every input slot, prompt slots too
              "trained_slots": sum(len(e["features"]) for e in examples)}  # fmt: skip
    if held:
        report["held_out_before"] = chain_acceptance(head, held, desc="untrained: held-out")
        if ships_an_ssm(target_name):
            default = load_model(DEFAULT_SSM_DIR, torch.float32, shared_embeddings_from=target)
            report["held_out_default_ssm"] = ssm_chain_acceptance(default, held)
    if (out_dir / "config.json").exists():
        made = json.loads((out_dir / "config.json").read_text()).get("specinfer", {})
        if {k: made.get(k) for k in info} != info:
            raise ValueError(f"{out_dir} holds a head made with other settings or data; use "
                             "another --out directory or delete it")  # fmt: skip
        tqdm.write(f"{out_dir.name}: already trained, loading it", file=sys.stderr)
    else:
        checkpoint = out / "checkpoint_feature.pt"
        distill(head, examples, settings, checkpoint, desc="training feature head",
                loss_fn=feature_loss)  # fmt: skip
        export_student(head, out_dir, tokenizer, head_tokens(examples), info, compact=True)
        checkpoint.unlink(missing_ok=True)
    head = load_model(out_dir, torch.float32, shared_embeddings_from=target)
    if held:
        report["held_out_after"] = chain_acceptance(head, held, desc="trained: held-out")
    report["export"] = str(out_dir)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for key in ("held_out_before", "held_out_after", "held_out_default_ssm"):
        if key in report:
            rates = " ".join(f"{k} {v:.1%}" for k, v in report[key].items())
            print(f"{key.removeprefix('held_out_')}: chain acceptance {rates}")
    return report
