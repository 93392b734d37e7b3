"""Tensor and pipeline parallelism on this machine: ms/token and tokens/s of the default model at
TP=1, TP=N and PP=M, incremental and speculative (the shipped SSM + prompt lookup), in one run.

    python benchmarks/bench_distributed.py [--tp 1 3] [--pp 2] [--prompts 8] [--tokens 64]
                                           [--dtype bfloat16] [--out results/distributed.json]

Each configuration decodes the same held-out chat prompts one at a time (batch 1, greedy) after
one warm-up prompt. TP=1 runs twice: one process with as many threads as TP=N uses in all, and
one with a single thread (what each rank gets). `comm_s` is rank 0's time in collectives, sends
and receives, waiting for its peers included: under PP that wait is mostly the other stages'
compute (batch 1 has one micro-batch, so the stages take turns). On a 2-core CPU, three 1-thread
ranks contend for two cores, so expect communication and contention to dominate; the point here
is correctness (every configuration's tokens are compared with TP=1's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import load_prompts  # noqa: E402
from results_io import save  # noqa: E402
from specinfer import Engine, SamplingParams  # noqa: E402

HERE = Path(__file__).parent


def run(args, tp: int, pp: int, threads: int, speculative: bool, prompts: list) -> dict:
    kwargs = {"ssm": ["default", "ngram"]} if speculative else {"mode": "incremental"}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    with Engine(args.model, dtype=args.dtype, threads=threads, tensor_parallel=tp,
                pipeline_parallel=pp, max_batch_size=1, **kwargs) as engine:  # fmt: skip
        engine.generate(prompts[0], params)  # warm-up: graphs, costs
        group = engine.workers.group if engine.workers else None
        comm0 = group.total_comm_s if group else 0.0
        start = time.perf_counter()
        outs = [engine.generate(p, params)[0] for p in prompts]
        wall = time.perf_counter() - start
        comm = (group.total_comm_s - comm0) if group else 0.0
    tokens = sum(len(o.token_ids) for o in outs)
    decode_s = sum(o.metrics["decode_s"] for o in outs)
    steps = sum(o.metrics["steps"] for o in outs)
    return {
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "threads_per_rank": threads,
        "mode": "speculative" if speculative else "incremental",
        "ms_per_token": 1000 * decode_s / sum(len(o.token_ids) - 1 for o in outs),
        "tokens_per_s": tokens / wall,
        "tokens_per_step": sum(len(o.token_ids) - 1 for o in outs) / steps,
        "comm_s": comm,
        "comm_fraction": comm / wall,
        "wall_s": wall,
        "token_ids": [o.token_ids for o in outs],
    }


def _same(outs: list, reference: list) -> int:
    return sum(a == b for a, b in zip(outs, reference))


def _name(r: dict) -> str:
    pp = r.get("pipeline_parallel", 1)
    return f"TP={r['tensor_parallel']}" + (f" PP={pp}" if pp > 1 else "")


def draw(result: dict, plt):
    rows = result["runs"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{_name(r)} x{r['threads_per_rank']}t\n{r['mode'][:4]}" for r in rows]
    bars = ax.bar(range(len(rows)), [r["ms_per_token"] for r in rows],
                  color=["tab:blue" if r["mode"] == "incremental" else "tab:orange" for r in rows])  # fmt: skip
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"comm {100 * r['comm_fraction']:.0f}%", ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms per token (batch 1)")
    ax.set_title(
        f"tensor and pipeline parallelism, {result['settings']['dtype']}, {os.cpu_count()} cores"
    )
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts-file", default=str(HERE / "data" / "held_out.jsonl"))
    ap.add_argument("--out", default=str(HERE / "results" / "distributed.json"))
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, args.prompts_file, chat=True)
    widest = max(args.tp + args.pp)
    cores = os.cpu_count() or 1
    configs = [(1, 1, max(1, min(cores, widest))), (1, 1, 1)]
    configs += [(tp, 1, 1) for tp in args.tp if tp > 1] + [(1, pp, 1) for pp in args.pp if pp > 1]
    runs = []
    for tp, pp, threads in configs:
        for speculative in (False, True):
            r = run(args, tp, pp, threads, speculative, prompts)
            print(f"{_name(r)} x {threads} thread(s) {r['mode']:11s}: {r['ms_per_token']:.1f} "
                  f"ms/token, {r['tokens_per_s']:.1f} tokens/s, {r['tokens_per_step']:.2f} "
                  f"tokens/step, comm {100 * r['comm_fraction']:.0f}%")  # fmt: skip
            runs.append(r)
    reference = runs[0]["token_ids"]
    for r, incremental in zip(
        runs, [r for r in runs for _ in (0, 1) if r["mode"] == "incremental"]
    ):
        r["identical_to_tp1"] = _same(r["token_ids"], reference)
        # Speculation must not change a configuration's own tokens (bf16 sums in another order
        # may change them vs TP=1: see the near-tie counts of tests/test_distributed.py).
        r["identical_to_incremental"] = _same(r["token_ids"], incremental["token_ids"])
        print(f"{_name(r)} x {r['threads_per_rank']}t {r['mode']}: {r['identical_to_tp1']}/"
              f"{len(prompts)} outputs identical to TP=1 incremental, "
              f"{r['identical_to_incremental']} to incremental in the same configuration")  # fmt: skip
    for r in runs:
        del r["token_ids"]
    settings = {"model": args.model, "dtype": args.dtype, "prompts": len(prompts),
                "tokens": args.tokens, "cores": cores, "torch": torch.__version__}  # fmt: skip
    save({"settings": settings, "runs": runs}, args.out, draw)


if __name__ == "__main__":
    main()
