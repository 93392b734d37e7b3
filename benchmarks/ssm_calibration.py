"""How well a drafter's confidence predicts acceptance: the default SSM's and the feature head's
top-1 drafts, teacher-forced on the target's own greedy answers to held-out chat prompts,
binned by the drafter's probability of the token: per bin, the share of drafts and how often
the target's next token was that draft. The cost-aware cut prices nodes by such bins
(budget.CONF_BINS), learned while serving; this shows what it has to learn from.

    python benchmarks/ssm_calibration.py [--prompts 60] [--tokens 128] \
        [--prompts-file benchmarks/data/held_out.jsonl] [--out benchmarks/results/ssm_calibration.json]

The feature head drafts UNROLL levels from each slot on its own guessed features (as serving
does); its bins are per level, the SSM's (whose context is the same at every level) once.
"""

from __future__ import annotations

import argparse

import torch

from bench_spec import load_prompts
from results_io import save
from specinfer import Engine, SamplingParams
from specinfer.default_model import DEFAULT_SSM_DIR, default_feature_path, local_model_path
from specinfer.loader import load_model
from specinfer.training.feature import UNROLL, draft_logits
from specinfer.training.scoring import completion_logits, completion_outputs

BINS = 10


def calibration(probs: list[torch.Tensor], hits: list[torch.Tensor]) -> dict:
    probs, hits = torch.cat(probs), torch.cat(hits).float()
    index = (probs * BINS).long().clamp(max=BINS - 1)
    bins = []
    for b in range(BINS):
        sel = index == b
        bins.append({"low": b / BINS, "high": (b + 1) / BINS, "share": sel.float().mean().item(),
                     "accepted": hits[sel].mean().item() if sel.any() else None})  # fmt: skip
    return {"drafts": len(probs), "accepted": hits.mean().item(), "bins": bins}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts-file", default="benchmarks/data/held_out.jsonl")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/ssm_calibration.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.prompts_file, chat=True)
    engine = Engine(dtype="bfloat16", threads=args.threads)  # the answers, as served
    outs = engine.generate(prompts, SamplingParams(max_tokens=args.tokens))
    seqs = [(engine.prompt_ids(p), o.token_ids) for p, o in zip(prompts, outs)]
    target = load_model(local_model_path(), torch.float32)
    ssm = load_model(DEFAULT_SSM_DIR, torch.float32, shared_embeddings_from=target)
    head = load_model(default_feature_path(local_model_path()), torch.float32,
                      shared_embeddings_from=target)  # fmt: skip
    result = {"prompts": len(prompts), "tokens": args.tokens, "prompts_file": args.prompts_file}
    probs, hits = [], []
    for (_, answer), logits in zip(seqs, completion_logits(ssm, seqs, desc="SSM")):
        top = logits.softmax(-1).max(-1)
        probs.append(top.values)
        hits.append(top.indices == torch.tensor(answer))
    result["default_ssm"] = calibration(probs, hits)
    examples = [{"prompt": p, "completion": c, "features": h.clone()}
                for (p, c), (_, h) in zip(seqs, completion_outputs(target, seqs, desc="features"))]  # fmt: skip
    per_level = [([], []) for _ in range(UNROLL)]
    for e, per_pass in zip(examples, draft_logits(head, examples, desc="feature head")):
        for (probs, hits), logits in zip(per_level, per_pass):
            top = logits.softmax(-1).max(-1)
            probs.append(top.values)
            hits.append(top.indices == torch.tensor(e["completion"]))
    result["feature_head"] = [calibration(p, h) for p, h in per_level]
    for name, rows in (
        ("default SSM", [result["default_ssm"]]),
        ("feature head", result["feature_head"]),
    ):
        for level, row in enumerate(rows, start=1):
            cells = " ".join(f"{b['accepted']:.2f}" if b["accepted"] is not None else "-"
                             for b in row["bins"])  # fmt: skip
            print(
                f"{name} level {level}: {row['accepted']:.1%} accepted; by confidence bin: {cells}"
            )
    save(result, args.out, plot)


def plot(result: dict, plt):
    fig, ax = plt.subplots(figsize=(6, 4.5))
    rows = [("default SSM", result["default_ssm"])]
    rows += [(f"feature head, level {i}", r) for i, r in enumerate(result["feature_head"], 1)]
    for name, row in rows:
        xs = [(b["low"] + b["high"]) / 2 for b in row["bins"] if b["accepted"] is not None]
        ys = [b["accepted"] for b in row["bins"] if b["accepted"] is not None]
        ax.plot(xs, ys, marker="o", label=name)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="acceptance = confidence")
    ax.set_xlabel("drafter's probability of its top-1 token (bin middle)")
    ax.set_ylabel("accepted (target's greedy token)")
    ax.set_title(f"Draft confidence vs acceptance, {result['prompts']} held-out prompts")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
