"""Greedy tokens per step of many tree configs from teacher data, without running the target.

    python benchmarks/tree_sim.py --ssm runs/l2/ssm --teacher runs/l2/teacher_held_out
                                  [--trees 1,1,1,1 2,1,1,1 ...] [--ngram ngram ngram:min_n=2]
                                  [--head 8192] [--out benchmarks/results/tree_sim.json]

Exact for greedy verification, and cheap: the node of a drafted tree that lies on the target's own
path at depth j is the SSM conditioned on the true prefix, i.e. the teacher-forced SSM. So an
expansion tree <k1..km> rooted at completion position i is accepted to depth d iff, for every
j < d, the target's token at i + j ranks below k_(j+1) in the SSM's distribution (over its
restricted head, as the engine drafts). A merged tree holds every sequence of its members, so it
accepts the longest of their accepted paths. The n-gram drafter depends on tokens only and is
replayed as is. One SSM forward per prompt; then each config is a loop over ranks. Use it to choose
a tree, then measure its latency with bench_spec.py (which runs the target).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from results_io import save
from specinfer.default_model import default_model_path
from specinfer.drafting import head_token_ids
from specinfer.loader import load_model
from specinfer.ngram import NgramConfig, NgramDrafter
from specinfer.training.scoring import completion_logits
from specinfer.tree import TreeConfig

TREES = ["1", "1,1", "2,1", "1,1,1,1", "2,1,1,1", "3,1,1,1", "2,2,1,1", "1,1,3,1,1,1,1,1",
         "3,2,1,1,1", "2,2,2,1,1,1,1,1", "3,3,2,1,1,1,1,1", "4,3,2,2,1,1,1,1", "5,5,3,3,2,2,2,2"]  # fmt: skip
NOT_IN_HEAD = 1 << 30


def load_examples(teacher: Path) -> list[dict]:
    shards = sorted(teacher.glob("shard_*.pt"))
    if not shards:
        raise SystemExit(f"no teacher shards in {teacher} (made by specinfer train-ssm)")
    return [e for s in shards for e in torch.load(s, weights_only=True)]


def ssm_ranks(ssm, head: list[int] | None, examples: list[dict]) -> list[list[int]]:
    """Per example and completion position: the rank of the target's token among the SSM's
    logits over its head (NOT_IN_HEAD when the head lacks it)."""
    cols = torch.tensor(head) if head is not None else None
    col_of = {t: i for i, t in enumerate(head)} if head is not None else None
    seqs = [(e["prompt"], e["completion"]) for e in examples]
    ranks = []
    for (_, completion), logits in zip(seqs, completion_logits(ssm, seqs)):
        if cols is not None:
            logits = logits[:, cols]
        index = [col_of.get(t) if col_of else t for t in completion]
        row = []
        for j, c in enumerate(index):
            row.append(NOT_IN_HEAD if c is None else int((logits[j] > logits[j, c]).sum()))
        ranks.append(row)
    return ranks


def ngram_accepts(config: NgramConfig, example: dict) -> list[int]:
    """Per completion position i >= 1: how many of the drafter's proposed tokens the target
    accepts there (the longest matching proposal)."""
    drafter, prompt, completion = NgramDrafter(config), example["prompt"], example["completion"]
    index = drafter.new_index()
    accepted = [0]
    for i in range(1, len(completion)):
        seq = prompt + completion[:i]
        index.extend(seq)
        best = 0
        for cont in drafter.continuations(index, seq, config.depth):
            a = 0
            while a < len(cont) and i + a < len(completion) and cont[a] == completion[i + a]:
                a += 1
            best = max(best, a)
        accepted.append(best)
    return accepted


def tokens_per_step(widths, ranks, ngram) -> float:
    """Decode every completion greedily with the merged drafts: tokens per target step."""
    steps = tokens = 0
    for e, r in enumerate(ranks):
        i = 1  # completion[0] comes from the prefill
        while i < len(r):
            d = 0
            while d < len(widths) and i + d < len(r) and r[i + d] < widths[d]:
                d += 1
            if ngram is not None:
                d = max(d, ngram[e][i])
            n = min(d + 1, len(r) - i)
            i, tokens, steps = i + n, tokens + n, steps + 1
    return tokens / max(1, steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ssm", required=True, help="SSM directory (train-ssm's export)")
    parser.add_argument("--teacher", required=True, help="teacher data directory (shards)")
    parser.add_argument("--model", default=None, help="target (default: the default model)")
    parser.add_argument("--head", type=int, default=None, help="SSM LM head tokens (0 = full)")
    parser.add_argument("--trees", nargs="+", default=TREES)
    parser.add_argument("--ngram", nargs="+", default=["ngram", "ngram:min_n=2"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/tree_sim.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_path = Path(args.model) if args.model else default_model_path()
    target = load_model(target_path, torch.float32)
    ssm = load_model(args.ssm, torch.float32, shared_embeddings_from=target)
    head = head_token_ids(args.ssm, args.head, target.config.vocab_size)
    examples = load_examples(Path(args.teacher))
    ranks = ssm_ranks(ssm, head, examples)
    flat = [x for r in ranks for x in r]
    result = {"ssm": args.ssm, "teacher": args.teacher, "head": len(head) if head else None,
              "prompts": len(examples), "positions": len(flat),
              "agreement": {f"top{k}": sum(x < k for x in flat) / len(flat) for k in (1, 3, 5)},
              "trees": {}}  # fmt: skip
    ngrams = {s: [ngram_accepts(NgramConfig.parse(s), e) for e in examples] for s in args.ngram}
    result["ngram_alone"] = {s: tokens_per_step((), ranks, a) for s, a in ngrams.items()}
    print("agreement", {k: round(v, 3) for k, v in result["agreement"].items()})
    print("n-gram alone", {k: round(v, 3) for k, v in result["ngram_alone"].items()})
    for spec in args.trees:
        tree = TreeConfig.parse(spec, max_nodes=sys.maxsize)  # no verification here: any size
        widths = tree.widths
        row = {"nodes": tree.num_nodes, "ssm": tokens_per_step(widths, ranks, None)}
        row |= {f"ssm + {s}": tokens_per_step(widths, ranks, a) for s, a in ngrams.items()}
        result["trees"][spec] = row
        print(spec, {k: round(v, 3) for k, v in row.items()})
    save(result, args.out, plot)


def plot(result: dict, plt):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    trees = result["trees"]
    nodes = [row["nodes"] for row in trees.values()]
    for key in next(iter(trees.values())):
        if key != "nodes":
            ax.plot(nodes, [row[key] for row in trees.values()], marker="o", label=key)
    for spec, row in trees.items():
        ax.annotate(spec, (row["nodes"], row["ssm"]), fontsize=6, rotation=30)
    ax.set(xscale="log", xlabel="SSM tree nodes (log)", ylabel="tokens per step (greedy)",
           title=f"simulated from teacher data: {Path(result['ssm']).name}")  # fmt: skip
    return fig


if __name__ == "__main__":
    main()
