"""Speculative decoding on the default model, the SpecInfer paper's tables and latency, in one run.

    python benchmarks/bench_spec.py [--model PATH] [--ssm layers:4] [--ssm-head N] [--ngram SPEC]
                                    [--prompts 8] [--tokens 64]

- Table 1 analog: how often the target's next token (greedy, and sampled at T=1) is in the SSM's
  top-1/3/5, teacher-forced over the target's own completions.
- Table 2 analog: tokens per step for trees <1,1,w,1,1,1,1,1>, w = 1..5, greedy and stochastic.
- Table 3 analog: multi-step speculative sampling vs naive sampling, tokens per step.
- Per-token latency of incremental vs sequence vs tree at batch 1, 2, 4, 8, 16.
- Drafters at batch 1: the n-gram drafter alone, the SSM alone, and both merged into one tree:
  latency, tokens per step, accepted nodes per SSM, and one iteration's time broken down (each
  SSM's drafting, target tree forward, verify, commit).
The prompts are real text nobody here wrote (openings of standard-library docstrings) unless
--prompts-file gives others. Writes JSON and PNG plots next to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pydoc
import time
from pathlib import Path

import torch

from results_io import save
from specinfer import Engine, SamplingParams
from specinfer.training.evaluate import target_tokens, topk_agreement
from specinfer.tree import TreeConfig

# Modules with long docstrings; prompts are their first 400 characters.
STDLIB = ["json", "os.path", "collections", "itertools", "re", "argparse", "csv", "heapq",
          "statistics", "string", "logging", "functools.reduce", "textwrap.wrap", "bisect.bisect_left",
          "datetime.datetime", "subprocess"]  # fmt: skip


def load_prompts(n: int, file: str | None) -> list[str]:
    if file:
        lines = Path(file).read_text().splitlines()
        texts = [
            json.loads(x)["prompt"] if file.endswith(".jsonl") else x for x in lines if x.strip()
        ]
    else:
        texts = [inspect.getdoc(pydoc.locate(name))[:400] for name in STDLIB]
    if not texts:
        raise SystemExit(f"no prompts in {file}")
    return (texts * n)[:n]


def coverage(engine: Engine, prompts: list[str], tokens: int) -> dict:
    """Table 1: P(target token in SSM top-k) for k = 1, 3, 5, over the target's completions."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    seqs = [(engine.tokenizer.encode(p), o.token_ids) for p, o in zip(prompts, outs)]
    ssm = engine.drafter.ssms[0].model
    return topk_agreement(ssm, seqs, target_tokens(engine.model, seqs))


def tokens_per_step(engine: Engine, prompts: list[str], tokens: int, temperature: float) -> float:
    params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    outs = engine.generate(prompts, params)
    steps = sum(o.metrics["steps"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / steps


def latency_ms(engine: Engine, prompts: list[str], tokens: int) -> dict:
    """Per-token latency: (time for N tokens - time for 1) / (N - 1), so prefill is excluded."""

    def run(n):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0, outs

    run(2)  # warm-up
    first, _ = run(1)
    full, outs = run(tokens)
    m = [o.metrics for o in outs]
    steps = max(1, sum(x["steps"] for x in m))
    per_step = 1000 / max(1, m[0]["steps"])  # the batch's step times, seen by every request
    return {
        "ms_per_token": 1000 * (full - first) / (tokens - 1),
        "tokens_per_step": sum(x["generated_tokens"] - 1 for x in m) / steps,
        "breakdown_ms_per_step": {
            **{k: per_step * m[0][k] for k in ("ssm_s", "target_s", "verify_s", "commit_s")},
            "per_ssm": {s["name"]: per_step * s["ssm_s"] for s in m[0]["per_ssm"]},
        },
        "accepted_per_ssm": {
            s["name"]: sum(x["per_ssm"][i]["accepted"] for x in m)
            for i, s in enumerate(m[0]["per_ssm"])
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--ssm", default="layers:4", help="SSM: a model path or layers:L")
    parser.add_argument(
        "--ssm-head", type=int, default=None, help="SSM LM head over N tokens (0 = full)"
    )
    parser.add_argument("--ngram", default="ngram", help="n-gram drafter spec, e.g. ngram:depth=6")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument(
        "--prompts-file", default=None, help=".txt (one per line) or .jsonl with 'prompt'"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tree", default="1,1,3,1,1,1,1,1")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", default="benchmarks/results/spec.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.prompts_file)
    base = dict(model=args.model, dtype=args.dtype, threads=args.threads, ssm=args.ssm,
                ssm_head=args.ssm_head)  # fmt: skip
    result = {"ssm": args.ssm, "ssm_head": args.ssm_head, "ngram": args.ngram, "dtype": args.dtype,
              "threads": args.threads, "tokens": args.tokens, "prompts": len(prompts),
              "tree": args.tree}  # fmt: skip

    engine = Engine(**base, tree=args.tree)
    result["table1_coverage"] = coverage(engine, prompts, args.tokens)
    print("table 1:", json.dumps(result["table1_coverage"]))

    table2 = {}
    for w in range(1, 6):
        tree = TreeConfig((1, 1, w, 1, 1, 1, 1, 1))
        engine = Engine(**base, tree=tree)
        table2[w] = {
            t: tokens_per_step(engine, prompts, args.tokens, temp)
            for t, temp in (("greedy", 0.0), ("stochastic", 1.0))
        }
        print(f"table 2: width {w}: {table2[w]}")
    result["table2_tokens_per_step"] = table2

    table3 = {}
    for w in (2, 3, 4, 5):
        tree = TreeConfig((1, 1, w, 1, 1, 1, 1, 1))
        table3[w] = {v: tokens_per_step(Engine(**base, tree=tree, verifier=v), prompts, args.tokens, 1.0)
                     for v in ("mss", "naive")}  # fmt: skip
        print(f"table 3: width {w}: {table3[w]}")
    result["table3_mss_vs_naive"] = table3

    latency = {}
    engines = {"incremental": Engine(**{**base, "ssm": None}),
               "sequence": Engine(**base, tree=args.tree, mode="sequence"),
               "tree": Engine(**base, tree=args.tree)}  # fmt: skip
    for batch in args.batches:
        batch_prompts = (prompts * batch)[:batch]
        latency[batch] = {
            mode: latency_ms(e, batch_prompts, args.tokens) for mode, e in engines.items()
        }
        print(
            f"latency batch {batch}:",
            {m: round(v["ms_per_token"], 1) for m, v in latency[batch].items()},
        )
    result["latency"] = latency

    drafters = {}
    for name, ssm in ((args.ngram, args.ngram), (args.ssm, args.ssm),
                      (f"{args.ssm} + {args.ngram}", [args.ssm, args.ngram])):  # fmt: skip
        engine = Engine(**{**base, "ssm": ssm}, tree=args.tree)
        drafters[name] = latency_ms(engine, prompts[:1], args.tokens)
        row = drafters[name]
        print(f"drafter {name}: {row['ms_per_token']:.1f} ms/token, "
              f"{row['tokens_per_step']:.2f} tokens/step, {row['breakdown_ms_per_step']}")  # fmt: skip
    result["drafters_batch1"] = drafters

    save(result, args.out, plot)


def plot(result: dict, plt):
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    t2 = result["table2_tokens_per_step"]
    widths = list(t2)
    for kind in ("greedy", "stochastic"):
        axes[0].plot(widths, [t2[w][kind] for w in widths], marker="o", label=kind)
    axes[0].set(
        title="tokens/step vs tree width <1,1,w,1,...>", xlabel="width w", ylabel="tokens per step"
    )
    t3 = result["table3_mss_vs_naive"]
    for v in ("mss", "naive"):
        axes[1].plot(list(t3), [t3[w][v] for w in t3], marker="o", label=v)
    axes[1].set(
        title="stochastic: MSS vs naive sampling", xlabel="width w", ylabel="tokens per step"
    )
    lat = result["latency"]
    for mode in ("incremental", "sequence", "tree"):
        axes[2].plot(list(lat), [lat[b][mode]["ms_per_token"] for b in lat], marker="o", label=mode)
    axes[2].set(
        title=f"per-token latency (SSM {result['ssm']})", xlabel="batch size", ylabel="ms per token"
    )
    _plot_breakdown(axes[3], result["drafters_batch1"])
    for ax in axes:
        ax.legend()
    return fig


def _plot_breakdown(ax, drafters: dict) -> None:
    """One stacked bar per drafter: each SSM's drafting, then target, verify, commit."""
    names = list(drafters)
    rows = [drafters[n]["breakdown_ms_per_step"] for n in names]
    parts = [(f"draft {s}", [r["per_ssm"].get(s, 0.0) for r in rows])
             for s in dict.fromkeys(s for r in rows for s in r["per_ssm"])]  # fmt: skip
    parts += [(k, [r[f"{k}_s"] for r in rows]) for k in ("target", "verify", "commit")]
    bottom = [0.0] * len(names)
    for label, values in parts:
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="one iteration at batch 1", ylabel="ms per step")
    ax.tick_params(axis="x", labelrotation=15)


if __name__ == "__main__":
    main()
