"""Compare sets of SSMs merged into one tree (e.g. boosted vs independently trained), in one run:
tokens per step, verified tree size and accepted nodes per SSM, greedy, on the same prompts.

    python benchmarks/bench_ssm_sets.py --set boosted runs/l2/ssm_1 runs/l2/ssm_2 \\
        --set independent runs/l2/independent_1 runs/l2/independent_2 \\
        --prompts-file benchmarks/data/held_out.jsonl --chat [--tree 1,1,1,1] [--tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from bench_spec import load_prompts
from results_io import save
from specinfer import Engine, SamplingParams


def measure(ssms: list[str], tree: str, prompts: list, tokens: int, dtype: str) -> dict:
    engine = Engine(
        dtype=dtype, ssm=ssms, tree=tree, max_batch_size=len(prompts), adaptive_tree=False
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens))
    steps = sum(o.metrics["steps"] for o in outs) or 1
    return {
        "ssms": ssms,
        "tokens_per_step": sum(len(o.token_ids) - 1 for o in outs) / steps,
        "tree_nodes_per_step": sum(o.metrics["tree_nodes"] for o in outs) / steps,
        "accepted_per_ssm": [
            sum(o.metrics["per_ssm"][i]["accepted"] for o in outs) for i in range(len(ssms))
        ],  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--set", nargs="+", action="append", required=True,
                        metavar=("NAME", "SSM"), help="a name and the SSMs merged")  # fmt: skip
    parser.add_argument("--prompts-file", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--tree", default="1,1,1,1")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/ssm_sets.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.prompts_file, args.chat)
    result = {"tree": args.tree, "tokens": args.tokens, "prompts": len(prompts), "sets": {}}
    for name, *ssms in args.set:
        if not ssms:
            raise SystemExit(f"--set {name}: give at least one SSM")
        result["sets"][name] = row = measure(ssms, args.tree, prompts, args.tokens, args.dtype)
        print(f"{name}: {row['tokens_per_step']:.2f} tokens/step, "
              f"{row['tree_nodes_per_step']:.1f} tree nodes/step, accepted {row['accepted_per_ssm']}")  # fmt: skip
    save(result, args.out, plot)


def plot(result: dict, plt):
    names = list(result["sets"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, [result["sets"][n]["tokens_per_step"] for n in names])
    ax.set(title=f"merged SSM sets, tree {result['tree']}", ylabel="tokens per step (greedy)")
    return fig


if __name__ == "__main__":
    main()
