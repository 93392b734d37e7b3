"""What repetition penalties cost a decoding step: the CLI's sampling defaults (temperature 0.2,
top-p 0.9, frequency penalty 0.3) on held-out chat prompts, the default model and drafting, with
the penalties computed by the compiled kernel (`Penalties.apply`) and by the torch path
(`Penalties.apply_reference`), in turn, group by group, in one process: the same engine, so only
the penalties differ. Also the time inside the penalties per step.

    python benchmarks/bench_penalties.py [--prompts 24] [--tokens 64] [--batches 1 8]
        [--prompts-file benchmarks/data/held_out.jsonl] [--out benchmarks/results/penalties.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from results_io import save
from specinfer import Engine, SamplingParams
from specinfer.default_model import DEFAULT_DRAFTING
from specinfer.sampling import Penalties

PATHS = {"kernel": Penalties.apply, "torch": Penalties.apply_reference}


def timed(path, stats: dict):
    """Penalties.apply as `path`, its calls counted and timed into stats."""

    def apply(penalties, *args, **kwargs):
        start = time.perf_counter()
        try:
            return path(penalties, *args, **kwargs)
        finally:
            stats["penalty_seconds"] += time.perf_counter() - start
            stats["penalty_calls"] += 1

    return apply


def run_group(engine: Engine, prompts: list, params: SamplingParams, path) -> dict:
    stats = {"penalty_calls": 0, "penalty_seconds": 0.0}
    Penalties.apply = timed(path, stats)
    before = dict(engine.counters)
    start = time.perf_counter()
    try:
        outs = engine.generate(prompts, params)
    finally:
        Penalties.apply = PATHS["kernel"]
    seconds = time.perf_counter() - start
    done = {k: engine.counters[k] - before[k] for k in ("spec_steps_total", "spec_drafts_total",
                                                        "spec_emitted_tokens_total")}  # fmt: skip
    return {"seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs), **done, **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompts-file", default="benchmarks/data/held_out.jsonl")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/penalties.json")
    args = parser.parse_args()

    lines = Path(args.prompts_file).read_text().splitlines()[: args.prompts]
    prompts = [[{"role": "user", "content": json.loads(line)["prompt"]}] for line in lines]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.2, top_p=0.9,
                            frequency_penalty=0.3, ignore_eos=True)  # fmt: skip
    engine = Engine(None, dtype=args.dtype, threads=args.threads, ssm=list(DEFAULT_DRAFTING),
                    max_batch_size=max(args.batches))  # fmt: skip
    rows = []
    for batch in args.batches:
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        for path in PATHS.values():  # untimed: graphs recorded, drafters' rates settled
            run_group(engine, groups[0], params, path)
        runs = {name: [] for name in PATHS}
        for g, group in enumerate(groups):
            order = list(PATHS) if g % 2 == 0 else list(PATHS)[::-1]
            for name in order:
                runs[name].append(run_group(engine, group, params, PATHS[name]))
        for name, results in runs.items():
            tokens = sum(r["tokens"] for r in results)
            steps = sum(r["spec_steps_total"] for r in results)
            row = {
                "batch": batch, "path": name, "groups": len(results), "tokens": tokens,
                "ms_per_token": 1000 * sum(r["seconds"] for r in results) / tokens,
                "ms_per_token_median_group": statistics.median(
                    1000 * r["seconds"] / r["tokens"] for r in results),
                "penalty_ms_per_step": 1000 * sum(r["penalty_seconds"] for r in results) / steps,
                "penalty_calls_per_step": sum(r["penalty_calls"] for r in results) / steps,
                "penalty_ms_per_token": 1000 * sum(r["penalty_seconds"] for r in results) / tokens,
                # a request's tokens per step (emitted per verified tree)
                "tokens_per_step": sum(r["spec_emitted_tokens_total"] for r in results)
                / sum(r["spec_drafts_total"] for r in results),
            }  # fmt: skip
            rows.append(row)
            print(f"batch {batch:2d} {name:6s}: {row['ms_per_token']:.2f} ms/token, "
                  f"penalties {row['penalty_ms_per_step']:.2f} ms a step "
                  f"({row['penalty_calls_per_step']:.1f} calls), "
                  f"{row['tokens_per_step']:.2f} tokens/step")  # fmt: skip
    result = {"args": vars(args), "sampling": "temperature 0.2, top_p 0.9, frequency_penalty 0.3",
              "drafting": list(DEFAULT_DRAFTING), "rows": rows}  # fmt: skip
    save(result, args.out, draw)


def draw(result: dict, plt):
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"batch {r['batch']}\n{r['path']}" for r in rows]
    ax.bar(labels, [r["ms_per_token"] for r in rows], label="all of a token")
    ax.bar(labels, [r["penalty_ms_per_token"] for r in rows], label="of which penalties")
    ax.set_ylabel("ms per token (batch total)")
    ax.set_title("Penalised sampling: compiled kernel vs torch path")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
