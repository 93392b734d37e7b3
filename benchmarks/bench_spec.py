"""Speculative decoding on the default model, the SpecInfer paper's tables and latency, in one run.

    python benchmarks/bench_spec.py [--model PATH] [--ssm layers:4] [--ssm-head N] [--ngram SPEC]
                                    [--prompts 8] [--tokens 64] [--prompts-file F --chat]
                                    [--sections table1 trees latency ...]

- Table 1 analog: how often the target's next token (greedy, and sampled at T=1) is in the SSM's
  top-1/3/5, teacher-forced over the target's own completions.
- Table 2 analog: tokens per step for trees <1,1,w,1,1,1,1,1>, w = 1..5, greedy and stochastic.
- Table 3 analog: multi-step speculative sampling vs naive sampling, tokens per step.
- Per-token latency of incremental vs sequence vs tree at batch 1, 2, 4, 8, 16.
- Tree configs at batch 1 (--trees, optionally merged with --trees-ngram): tokens per step and
  per-token latency of each, to pick the best one for a given SSM.
- Rows: one target forward (recorded graph, plus the LM head on every row, as verification
  does) over a causal chain of T tree nodes at batch 1, T = 1..64, after a real prompt: what
  each extra node costs, the number every tree size trades against its tokens per step. Where
  the engine packs its weights for this CPU's linear (ops.panels_preferred), the same with the
  weights as loaded, in turn in one run.
- N-gram drafters at batch 1 (--ngrams): incremental decoding and each n-gram spec alone, to
  choose the prompt-lookup default (it needs no SSM, so it is what `specinfer generate` runs).
- Drafters at batch 1: the n-gram drafter alone, the SSM alone, and both merged into one tree:
  latency, tokens per step, accepted nodes per SSM, and one iteration's time broken down (each
  SSM's drafting, target tree forward, verify, commit).
- Fresh (--paired configurations, --fresh-prompts K): what a new engine gives from its first
  request, as `specinfer generate` runs: for every K consecutive prompts a fresh engine per
  configuration, the prompts one at a time, configurations in turn as in the paired section;
  per engine, ms per generated token (prefill included: a fresh engine records its graphs as
  it goes) and tokens per step; mean, worst and every engine's.
- Acceptance (--acceptance SSMs): real greedy decoding with each SSM alone drafting whole chains
  of 3: per depth d, the fraction of steps whose first d drafted tokens were accepted.
- Paired (--paired): incremental decoding and drafting configurations run prompt by prompt in
  turn (each prompt through every configuration before the next prompt), so drift of a shared
  machine's speed hits all alike; per-token latency, tokens per step and speedup over incremental,
  and the tokens per step each configuration's step time would need for 2x over incremental.
  A configuration is "incremental", or drafters merged with "+": an n-gram spec, an SSM tree
  ("1,1": the --ssm with that tree), or any SSM spec, optionally with a tree ("default",
  "feature:PATH@2,2,1"; without one it drafts the tree the budget sizes): "1,1+ngram",
  "feature:PATH+ngram". Each configuration's drafters report their accepted tokens and
  milliseconds a step (per_ssm). Speculative ones cut their
  trees to what pays (the engine's default, budget.TreeBudget) unless prefixed "whole:"
  ("whole:1,1+ngram" verifies every drafted node); prefixed "fp:", their SSMs draft with their
  weights as loaded instead of 8-bit copies (the engine's ssm_int8, default on the CPU), e.g.
  "fp:feature+ngram" next to "feature+ngram". The other sections verify whole trees: they
  measure the shapes they are given.
- Exact (--paired configurations): greedy output of each speculative configuration against
  incremental decoding, prompt by prompt: how many prompts give the same --tokens tokens, and
  where the first that does not diverges.
The prompts are real text nobody here wrote (openings of standard-library docstrings) unless
--prompts-file gives others; --chat sends each as a user message through the chat template, as
`specinfer generate` does. Writes JSON and PNG plots next to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pydoc
import re
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from unittest.mock import patch

import torch
from tqdm import tqdm

from results_io import save
from specinfer import Engine, SamplingParams, ops
from specinfer.drafting import is_lookup_spec
from specinfer.training.evaluate import target_tokens, topk_agreement
from specinfer.tree import TreeConfig

# Modules with long docstrings; prompts are their first 400 characters.
STDLIB = ["json", "os.path", "collections", "itertools", "re", "argparse", "csv", "heapq",
          "statistics", "string", "logging", "functools.reduce", "textwrap.wrap", "bisect.bisect_left",
          "datetime.datetime", "subprocess"]  # fmt: skip


SECTIONS = ("table1", "table2", "table3", "latency", "trees", "drafters", "ngrams", "rows",
            "paired", "fresh", "acceptance", "exact")  # fmt: skip


def parse_sampling(text: str) -> dict:
    """'temperature=0.2,top_k=40' -> {"temperature": 0.2, "top_k": 40}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if key.strip() in ("top_k", "seed") else float(value)
    SamplingParams(**out)  # names the bad field now, not after the models load
    return out


def load_prompts(n: int, file: str | None, chat: bool) -> list:
    if file:
        lines = Path(file).read_text().splitlines()
        texts = [
            json.loads(x)["prompt"] if file.endswith(".jsonl") else x for x in lines if x.strip()
        ]
    else:
        texts = [inspect.getdoc(pydoc.locate(name))[:400] for name in STDLIB]
    if not texts:
        raise SystemExit(f"no prompts in {file}")
    # Evenly spaced: a prompt file grouped by source contributes every source.
    texts = texts[:: max(1, len(texts) // n)][:n] if len(texts) > n else (texts * n)[:n]
    return [[{"role": "user", "content": t}] for t in texts] if chat else texts


def coverage(engine: Engine, prompts: list[str], tokens: int) -> dict:
    """Table 1: P(target token in SSM top-k) for k = 1, 3, 5, over the target's completions."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    seqs = [(engine.prompt_ids(p), o.token_ids) for p, o in zip(prompts, outs)]
    ssm = engine.drafter.ssms[0].model
    return topk_agreement(ssm, seqs, target_tokens(engine.model, seqs))


def tokens_per_step(engine: Engine, prompts: list[str], tokens: int, temperature: float) -> float:
    params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    outs = engine.generate(prompts, params)
    steps = sum(o.metrics["steps"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / steps


def latency_ms(engine: Engine, prompts: list, tokens: int, batch: int, sampling=None) -> dict:
    """Per-token latency of requests run `batch` at a time, over every group of the prompts:
    while all of a group's requests decode (from the step that gave the last of them its first
    token to the step that finished the first of them: no prefill runs then), seconds per token
    a request gained, the mean over the group's requests (at batch 1, (time for N tokens - time
    for 1) / (N - 1)). `sampling`: more SamplingParams fields (default: greedy)."""
    groups = [(prompts * batch)[i : i + batch] for i in range(0, max(len(prompts), batch), batch)]
    groups = [g for g in groups if len(g) == batch]

    def run(group, n):
        params = SamplingParams(max_tokens=n, ignore_eos=True, **(sampling or {}))
        return engine.generate(group, params)

    # Warm-up: a whole run, so op graphs are recorded for the shapes it reaches and the cut has
    # learned its costs and rates, as in a server that has run a while (two tokens left a batch
    # of 16 learning, at over twice the steady step time, for much of the first group). A
    # suffix drafter forgets it: it must not draft the first group's answers from themselves.
    with engine.unrecorded():
        run(groups[0], tokens)
    decode_ms, outs, leads = [], [], []
    for group in groups:
        with _token_times(engine) as times:
            group_outs = run(group, tokens)
        decode_ms.append(_decoding_ms_per_token(times))
        outs += group_outs
        # A batch's step times are shared by its requests; the one that ran longest was in
        # every step of the batch (the first to end was not: its steps undercount the batch's).
        leads.append(max(group_outs, key=lambda o: o.metrics["steps"]).metrics)
    steps = sum(x["steps"] for x in leads) or 1
    per_ssm = [s["name"] for s in leads[0]["per_ssm"]]

    def ms_per_step(key, i=None):
        return 1000 * sum((x if i is None else x["per_ssm"][i])[key] for x in leads) / steps

    return {
        "ms_per_token": sum(decode_ms) / len(decode_ms),
        "tokens_per_step": sum(o.metrics["generated_tokens"] - 1 for o in outs)
        / max(1, sum(o.metrics["steps"] for o in outs)),
        # Nodes of the verified tree a request had a step, root included: the target forward's
        # rows per request, what the cut let trees grow to (no drafter: no tree, one row).
        "nodes_per_step": sum(o.metrics["tree_nodes"] for o in outs)
        / max(1, sum(o.metrics["steps"] for o in outs))
        or 1.0,
        "breakdown_ms_per_step": {
            **{k: ms_per_step(k) for k in ("ssm_s", "target_s", "verify_s", "commit_s")},
            "per_ssm": {name: ms_per_step("ssm_s", i) for i, name in enumerate(per_ssm)},
        },
        "accepted_per_ssm": {
            name: sum(o.metrics["per_ssm"][i]["accepted"] for o in outs)
            for i, name in enumerate(per_ssm)
        },
    }


@contextmanager
def _token_times(engine: Engine):
    """Per request id, (time, tokens so far) after each engine step that gave it tokens."""
    times: dict = {}
    step = engine.step

    def timed_step():
        outs = step()
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                times.setdefault(o.request_id, []).append((now, o.completion_tokens))
        return outs

    with patch.object(engine, "step", timed_step):
        yield times


def _decoding_ms_per_token(times: dict) -> float:
    """ms per token while every request decodes (see latency_ms), from _token_times."""
    start = max(t[0][0] for t in times.values())
    end = min(t[-1][0] for t in times.values())

    def tokens_at(t: list, when: float) -> int:
        return max(n for at, n in t if at <= when)

    gained = [tokens_at(t, end) - tokens_at(t, start) for t in times.values()]
    if end <= start or min(gained) == 0:  # never all decoding at once: each request's own run
        spans = [(t[-1][0] - t[0][0], t[-1][1] - t[0][1]) for t in times.values()]
        return sum(1000 * s / max(1, n) for s, n in spans) / len(spans)
    return sum(1000 * (end - start) / g for g in gained) / len(gained)


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
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tree", default="1,1,3,1,1,1,1,1")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--trees",
        nargs="+",
        default=["1,1,1,1", "2,1,1,1", "2,2,1,1", "1,1,3,1,1,1,1,1", "3,2,1,1,1"],
    )
    parser.add_argument("--trees-ngram", default=None,
                        help="merge this n-gram drafter into every --trees config")  # fmt: skip
    parser.add_argument("--ngrams", nargs="+", default=["ngram", "ngram:min_n=2"])
    parser.add_argument("--paired", nargs="+", default=["incremental", "ngram", "1+ngram", "1,1+ngram"],
                        help="configurations of the paired section")  # fmt: skip
    parser.add_argument("--acceptance", nargs="+", default=["default", "feature"],
                        help="SSM specs of the acceptance section")  # fmt: skip
    parser.add_argument("--paired-batches", type=int, nargs="+", default=[1],
                        help="batch sizes of the paired section (requests run together, "
                        "consecutive prompts)")  # fmt: skip
    parser.add_argument("--fresh-prompts", type=int, default=4,
                        help="prompts each fresh engine of the fresh section runs")  # fmt: skip
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument(
        "--sampling",
        type=parse_sampling,
        default=None,
        help="the paired section's SamplingParams, e.g. temperature=0.2,top_p=0.9,"
        "repetition_penalty=1.1 (generate's defaults; default: greedy)",
    )
    parser.add_argument(
        "--json-schema",
        default=None,
        help='the paired section\'s requests held to a JSON schema (structured output): "object" '
        "(any JSON object) or a schema file",
    )
    parser.add_argument("--out", default="benchmarks/results/spec.json")
    args = parser.parse_args()
    if args.json_schema:
        schema = (
            {"type": "object"}
            if args.json_schema == "object"
            else json.loads(Path(args.json_schema).read_text())
        )
        args.sampling = {**(args.sampling or {}), "json_schema": schema}
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.prompts_file, args.chat)
    base = dict(model=args.model, dtype=args.dtype, threads=args.threads, ssm=args.ssm,
                ssm_head=args.ssm_head, adaptive_tree=False)  # fmt: skip
    result = {"ssm": args.ssm, "ssm_head": args.ssm_head, "ngram": args.ngram, "dtype": args.dtype,
              "threads": args.threads, "tokens": args.tokens, "prompts": len(prompts),
              "tree": args.tree, "chat": args.chat, "prompts_file": args.prompts_file,
              "trees_ngram": args.trees_ngram, "sampling": args.sampling,
              "fresh_prompts": args.fresh_prompts}  # fmt: skip
    run = set(args.sections)

    if "table1" in run:
        engine = Engine(**base, tree=args.tree)
        result["table1_coverage"] = coverage(engine, prompts, args.tokens)
        print("table 1:", json.dumps(result["table1_coverage"]))
    if "table2" in run:
        result["table2_tokens_per_step"] = table2(base, prompts, args.tokens)
    if "table3" in run:
        result["table3_mss_vs_naive"] = table3(base, prompts, args.tokens)
    if "latency" in run:
        result["latency"] = latency(base, args.tree, prompts, args.tokens, args.batches)
    if "trees" in run:
        result["trees_batch1"] = trees_batch1(base, args, prompts)
    if "drafters" in run:
        result["drafters_batch1"] = drafters(base, args, prompts)
    if "rows" in run:
        result.update(row_costs(base, prompts))
    if "ngrams" in run:
        result["ngrams_batch1"] = ngrams(base, args.ngrams, prompts, args.tokens)
    if "acceptance" in run:
        result["acceptance_by_depth"] = acceptance(base, args.acceptance, prompts, args.tokens)
    if "paired" in run:
        for batch in args.paired_batches:
            result[f"paired_batch{batch}"] = paired(base, args, prompts, batch)
    if "fresh" in run:
        result["fresh_engines"] = fresh(base, args, prompts)
    if "exact" in run:
        result["exact_greedy"] = exact(base, args, prompts)
    save(result, args.out, plot)


def table2(base: dict, prompts: list, tokens: int) -> dict:

    result = {}
    for w in range(1, 6):
        engine = Engine(**base, tree=TreeConfig((1, 1, w, 1, 1, 1, 1, 1)))
        result[w] = {
            t: tokens_per_step(engine, prompts, tokens, temp)
            for t, temp in (("greedy", 0.0), ("stochastic", 1.0))
        }
        print(f"table 2: width {w}: {result[w]}")
    return result


def table3(base: dict, prompts: list, tokens: int) -> dict:
    result = {}
    for w in (2, 3, 4, 5):
        tree = TreeConfig((1, 1, w, 1, 1, 1, 1, 1))
        result[w] = {v: tokens_per_step(Engine(**base, tree=tree, verifier=v), prompts, tokens, 1.0)
                     for v in ("mss", "naive")}  # fmt: skip
        print(f"table 3: width {w}: {result[w]}")
    return result


def latency(base: dict, tree: str, prompts: list, tokens: int, batches: list[int]) -> dict:
    result = {}
    engines = {"incremental": Engine(**{**base, "ssm": None}),
               "sequence": Engine(**base, tree=tree, mode="sequence"),
               "tree": Engine(**base, tree=tree)}  # fmt: skip
    for batch in batches:
        result[batch] = {mode: latency_ms(e, prompts, tokens, batch) for mode, e in engines.items()}
        print(
            f"latency batch {batch}:",
            {m: round(v["ms_per_token"], 1) for m, v in result[batch].items()},
        )
    return result


def trees_batch1(base: dict, args, prompts: list) -> dict:
    """Each --trees config for the SSM, alone or (--trees-ngram) merged with an n-gram drafter."""
    result = {}
    for t in args.trees:
        if args.trees_ngram:
            engine = Engine(**{**base, "ssm": [args.ssm, args.trees_ngram]}, tree=[t, None])
        else:
            engine = Engine(**base, tree=t)
        result[t] = row = latency_ms(engine, prompts, args.tokens, batch=1)
        print(f"tree {t}: {row['ms_per_token']:.1f} ms/token, "
              f"{row['tokens_per_step']:.2f} tokens/step, {row['breakdown_ms_per_step']}")  # fmt: skip
    return result


def drafters(base: dict, args, prompts: list) -> dict:
    result = {}
    for name, ssm in ((args.ngram, args.ngram), (args.ssm, args.ssm),
                      (f"{args.ssm} + {args.ngram}", [args.ssm, args.ngram])):  # fmt: skip
        engine = Engine(**{**base, "ssm": ssm}, tree=args.tree)
        result[name] = row = latency_ms(engine, prompts, args.tokens, batch=1)
        print(f"drafter {name}: {row['ms_per_token']:.1f} ms/token, "
              f"{row['tokens_per_step']:.2f} tokens/step, {row['breakdown_ms_per_step']}")  # fmt: skip
    return result


def _forward(model, runner, args):
    return model.compute_logits(runner(*args))


@torch.inference_mode()
def row_costs(base: dict, prompts: list, rounds: int = 5, reps: int = 2) -> dict:
    """ms of a target forward (recorded graph, LM head included) by row count; where this CPU's
    linear takes packed weights (ops.panels_preferred), also with the weights as loaded (the
    dot-product kernel), the two engines timed in turn in one process (min of the rounds)."""
    engines = {"target_forward_ms_by_rows": Engine(**{**base, "ssm": None})}
    if ops.panels_preferred(engines["target_forward_ms_by_rows"].dtype):
        # The same engine but for the layout: packing refused while it loads.
        with patch.object(ops, "panels_preferred", lambda dtype: False):
            engines["target_forward_ms_by_rows_as_loaded"] = Engine(**{**base, "ssm": None})
    forwards = {}  # (key, T): the forward's thunk
    for key, engine in engines.items():
        model, runner = engine.model, engine.run_model
        prompt = torch.tensor([engine.prompt_ids(prompts[0])])
        P = prompt.shape[1]
        kv = model.make_kv_cache(1, P + 64)
        one = torch.zeros(1, dtype=torch.long)
        causal = torch.ones(P, P, dtype=torch.bool).tril()[None]
        runner(prompt, torch.arange(P)[None], kv, one, one, causal)
        for T in (1, 2, 3, 4, 6, 9, 13, 21, 32, 48, 64):  # 48-64: a short prompt's prefill
            if T > P:  # the rows are the prompt's last T tokens
                break
            ids, mask = prompt[:, -T:], torch.ones(T, T, dtype=torch.bool).tril()[None]
            args = (ids, P + torch.arange(T)[None], kv, one, one + P, mask)
            forward = partial(_forward, model, runner, args)
            for _ in range(3):  # eager, recorded, replayed
                forward()
            forwards[key, T] = forward
    result = {key: {} for key in engines}
    for _ in range(rounds):
        for (key, T), forward in forwards.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                forward()
            ms = 1000 * (time.perf_counter() - t0) / reps
            result[key][T] = min(result[key].get(T, ms), ms)
    for T, ms in result["target_forward_ms_by_rows"].items():
        loaded = result.get("target_forward_ms_by_rows_as_loaded", {}).get(T)
        print(f"target forward, {T} rows: {ms:.1f} ms"
              + (f" (weights as loaded: {loaded:.1f})" if loaded else ""))  # fmt: skip
    for engine in engines.values():
        engine.run_model.release()
    return result


def ngrams(base: dict, specs: list[str], prompts: list, tokens: int) -> dict:
    result = {}
    for spec in [None, *specs]:
        row = latency_ms(Engine(**{**base, "ssm": spec}), prompts, tokens, batch=1)
        result[spec or "incremental"] = row
        print(f"{spec or 'incremental'}: {row['ms_per_token']:.1f} ms/token, "
              f"{row['tokens_per_step']:.2f} tokens/step")  # fmt: skip
    return result


def paired(base: dict, args, prompts: list, batch: int = 1) -> dict:
    """Each configuration on each group of `batch` prompts in turn, the order rotated each
    group (the machine's drift and a run's place after another's then hit all alike); means
    over groups (equal token counts)."""
    engines = {name: _engine(base, name, args.ssm) for name in args.paired}
    runs = {name: [] for name in engines}
    groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    names = list(engines)
    bar = tqdm(total=len(groups) * len(names), desc=f"paired batch {batch}", unit="run")
    for g, group in enumerate(groups):
        for i in range(len(names)):
            name = names[(g + i) % len(names)]
            runs[name].append(latency_ms(engines[name], group, args.tokens, batch, args.sampling))
            bar.update()
    bar.close()
    result = {}
    for name, rows in runs.items():
        result[name] = {
            key: sum(r[key] for r in rows) / len(rows)
            for key in ("ms_per_token", "tokens_per_step", "nodes_per_step")
        }
        result[name]["ms_per_step"] = sum(
            r["ms_per_token"] * r["tokens_per_step"] for r in rows
        ) / len(rows)
        result[name]["breakdown_ms_per_step"] = {
            key: sum(r["breakdown_ms_per_step"][key] for r in rows) / len(rows)
            for key in ("ssm_s", "target_s", "verify_s", "commit_s")
        }
        # A run whose requests all ended before a decode step (a structured output complete at
        # its first token) names no drafter: take the names from every run.
        drafters = dict.fromkeys(d for r in rows for d in r["accepted_per_ssm"])
        # What each drafter cost a step, and the accepted tokens only its tree held (a token
        # in two drafters' trees counts for both).
        result[name]["per_ssm"] = {
            d: {"ms_per_step": sum(r["breakdown_ms_per_step"]["per_ssm"].get(d, 0.0) for r in rows) / len(rows),
                "accepted_tokens": sum(r["accepted_per_ssm"].get(d, 0) for r in rows)}
            for d in drafters
        }  # fmt: skip
    base_ms = result.get("incremental", {}).get("ms_per_token")
    for name, row in result.items():
        if base_ms:
            row["speedup_vs_incremental"] = base_ms / row["ms_per_token"]
            # What this configuration's steps would have to yield to halve incremental latency.
            row["tokens_per_step_for_2x"] = 2 * row["ms_per_step"] / base_ms
        print(f"paired batch {batch} {name}: {row['ms_per_token']:.1f} ms/token, "
              f"{row['tokens_per_step']:.2f} tokens/step of {row['nodes_per_step']:.2f} nodes "
              f"(2x needs {row.get('tokens_per_step_for_2x', float('nan')):.2f}), "
              f"{row.get('speedup_vs_incremental', float('nan')):.2f}x incremental")  # fmt: skip
    return result


def _engine(base: dict, name: str, ssm: str) -> Engine:
    """The engine of a paired configuration (see the module docstring)."""
    whole = name.startswith("whole:")
    config = name.removeprefix("whole:")
    full_precision = config.startswith("fp:")
    config = config.removeprefix("fp:")
    kw = {**base, "adaptive_tree": not whole, **({"ssm_int8": False} if full_precision else {})}
    if config == "incremental":
        return Engine(**{**kw, "ssm": None})
    specs, trees = zip(*(_drafter(part, ssm) for part in config.split("+")))
    return Engine(**{**kw, "ssm": list(specs)}, tree=list(trees))


def fresh(base: dict, args, prompts: list) -> dict:
    """Per configuration, a fresh engine for every --fresh-prompts consecutive prompts, run one
    at a time from its first request (the order of configurations rotated per group)."""
    k = args.fresh_prompts
    groups = [prompts[i : i + k] for i in range(0, len(prompts) - k + 1, k)]
    names = list(args.paired)
    runs = {name: [] for name in names}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **(args.sampling or {}))
    bar = tqdm(total=len(groups) * len(names), desc="fresh engines", unit="engine")
    for g, group in enumerate(groups):
        for i in range(len(names)):
            name = names[(g + i) % len(names)]
            engine = _engine(base, name, args.ssm)
            t0 = time.perf_counter()
            outs = [engine.generate([p], params)[0] for p in group]
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.token_ids) for o in outs)
            steps = sum(o.metrics["steps"] for o in outs)  # decode steps, after prefill
            runs[name].append({"ms_per_token": 1000 * seconds / tokens,
                               "tokens_per_step": (tokens - len(outs)) / max(1, steps)})  # fmt: skip
            del engine
            bar.update()
    bar.close()
    result = {}
    for name, rows in runs.items():
        result[name] = row = {key: sum(r[key] for r in rows) / len(rows)
                              for key in ("ms_per_token", "tokens_per_step")}  # fmt: skip
        row["worst_tokens_per_step"] = min(r["tokens_per_step"] for r in rows)
        row["per_engine"] = rows
        print(f"fresh engines {name}: {row['ms_per_token']:.1f} ms/token with prefill, "
              f"{row['tokens_per_step']:.2f} tokens/step (worst engine "
              f"{row['worst_tokens_per_step']:.2f})")  # fmt: skip
    base_ms = result.get("incremental", {}).get("ms_per_token")
    for row in result.values():
        if base_ms:
            row["speedup_vs_incremental"] = base_ms / row["ms_per_token"]
    return result


def acceptance(base: dict, specs: list[str], prompts: list, tokens: int, depth: int = 3) -> dict:
    """Real decoding (greedy, whole chains of `depth`, each SSM alone): per depth d, the
    fraction of steps whose draft had its first d tokens accepted."""
    result = {}
    for spec in specs:
        engine = Engine(**{**base, "ssm": spec, "max_batch_size": 16}, tree=",".join(["1"] * depth))
        outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        steps = sum(o.metrics["steps"] for o in outs)
        per_depth = [sum((o.metrics["accepted_per_depth"] + [0] * depth)[d] for o in outs)
                     for d in range(depth)]  # fmt: skip
        result[spec] = {f"depth{d + 1}": n / steps for d, n in enumerate(per_depth)}
        print(f"acceptance {spec}:", " ".join(f"{k} {v:.1%}" for k, v in result[spec].items()))
    return result


def exact(base: dict, args, prompts: list) -> dict:
    """Per speculative --paired configuration: prompts whose greedy output equals incremental
    decoding's, token for token, and the first divergence (prompt, token index)."""
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    engine = _engine(base, "incremental", args.ssm)
    reference = [engine.generate([p], params)[0].token_ids for p in tqdm(prompts, "incremental")]
    result = {}
    for name in (n for n in args.paired if n != "incremental"):
        engine = _engine(base, name, args.ssm)
        equal, first = 0, None
        for i, prompt in enumerate(tqdm(prompts, name)):
            out = engine.generate([prompt], params)[0].token_ids
            if out == reference[i]:
                equal += 1
            elif first is None:
                pairs = zip(out, reference[i])
                token = next((j for j, (a, b) in enumerate(pairs) if a != b), len(out))
                first = {"prompt": i, "token": token}
        result[name] = {"equal": equal, "prompts": len(prompts), "first_mismatch": first}
        print(f"exact {name}: {equal}/{len(prompts)} prompts equal incremental decoding"
              + (f", first divergence {first}" if first else ""))  # fmt: skip
    return result


def _drafter(part: str, ssm: str) -> tuple[str, str | None]:
    """(SSM spec, tree) of one '+'-joined part of a paired configuration: an n-gram or suffix spec, a
    tree for --ssm ("1,1"), or an SSM spec with an optional tree ("feature:PATH@1,1"; without
    one it drafts what the engine gives it: sized by the budget, or its default tree)."""
    if is_lookup_spec(part):
        return part, None
    if part.replace(",", "").isdigit():
        return ssm, part
    spec, _, tree = part.partition("@")
    return spec, tree or None


def plot(result: dict, plt):
    panels = [(key, draw) for key, draw in (("table2_tokens_per_step", _plot_table2),
              ("table3_mss_vs_naive", _plot_table3), ("latency", _plot_latency),
              ("trees_batch1", _plot_trees), ("ngrams_batch1", _plot_ngrams),
              ("drafters_batch1", _plot_breakdown), ("target_forward_ms_by_rows", _plot_rows),
              *((k, _plot_paired) for k in result if k.startswith("paired_batch")),
              ("fresh_engines", _plot_fresh), ("exact_greedy", _plot_exact))
              if key in result]  # fmt: skip
    # Bar panels widen with their bars, so labels of many configurations do not overlap.
    widths = [max(5.0, 0.8 * len(result[key])) for key, _ in panels] or [5.0]
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), 4), width_ratios=widths)
    axes = axes if len(panels) > 1 else [axes]
    for ax, (key, draw) in zip(axes, panels):
        draw(ax, result[key], result)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return fig


def _plot_table2(ax, t2: dict, result: dict) -> None:
    for kind in ("greedy", "stochastic"):
        ax.plot(list(t2), [t2[w][kind] for w in t2], marker="o", label=kind)
    ax.set(title="tokens/step vs tree width <1,1,w,1,...>", xlabel="width w",
           ylabel="tokens per step")  # fmt: skip


def _plot_table3(ax, t3: dict, result: dict) -> None:
    for v in ("mss", "naive"):
        ax.plot(list(t3), [t3[w][v] for w in t3], marker="o", label=v)
    ax.set(title="stochastic: MSS vs naive sampling", xlabel="width w", ylabel="tokens per step")


def _plot_latency(ax, lat: dict, result: dict) -> None:
    for mode in ("incremental", "sequence", "tree"):
        ax.plot(list(lat), [lat[b][mode]["ms_per_token"] for b in lat], marker="o", label=mode)
    ax.set(title=f"per-token latency (SSM {result['ssm']})", xlabel="batch size",
           ylabel="ms per token")  # fmt: skip


def _plot_trees(ax, trees: dict, result: dict) -> None:
    merged = f" + {result['trees_ngram']}" if result.get("trees_ngram") else ""
    _bars(ax, trees, f"tree configs at batch 1{merged}")


def _plot_ngrams(ax, rows: dict, result: dict) -> None:
    _bars(ax, rows, "n-gram drafters at batch 1")


def _plot_paired(ax, rows: dict, result: dict) -> None:
    batch = next(k for k, v in result.items() if v is rows).removeprefix("paired_batch")
    _bars(ax, rows, f"paired runs at batch {batch}")
    if "incremental" in rows:
        ax.axhline(rows["incremental"]["ms_per_token"] / 2, linestyle="--", color="gray",
                   label="2x faster than incremental")  # fmt: skip


def _plot_fresh(ax, rows: dict, result: dict) -> None:
    _bars(ax, rows, f"fresh engines, {result.get('fresh_prompts', '')} prompts each (prefill in)")


def _labels(names: list[str]) -> list[str]:
    """Configuration names for an axis. A corpus path says little there: its file's stem, on a
    line of its own; a drafter, then an option, a line."""
    labels = [re.sub(r"corpus=(?:[^,+]*/)?([^,+/]*?)(?:\.jsonl)?(?=[,+]|$)", "corpus=\n\\1", t)
              for t in names]  # fmt: skip
    return [re.sub(r"([+:,])", "\\1\n", t) for t in labels]


def _plot_exact(ax, rows: dict, result: dict) -> None:
    names = list(rows)
    ax.bar(range(len(names)), [rows[n]["equal"] for n in names])
    ax.axhline(rows[names[0]]["prompts"], linestyle="--", color="gray", label="prompts run")
    ax.set_xticks(range(len(names)), _labels(names), fontsize=8)
    ax.set(title="greedy output equal to incremental decoding", ylabel="prompts")
    ax.legend(fontsize=8)


def _bars(ax, rows: dict, title: str) -> None:
    """ms per token of each row, annotated with its tokens per step."""
    names = list(rows)
    ax.bar(range(len(names)), [rows[t]["ms_per_token"] for t in names])
    for i, t in enumerate(names):
        ax.annotate(f"{rows[t]['tokens_per_step']:.2f} tok/step", (i, rows[t]["ms_per_token"]),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(names)), _labels(names), fontsize=8)
    # Headroom above the tallest bar for its label and a legend.
    top = max(rows[t]["ms_per_token"] for t in names)
    ax.set(title=title, ylabel="ms per token", ylim=(0, 1.3 * top))


def _plot_rows(ax, rows: dict, result: dict) -> None:
    loaded = result.get("target_forward_ms_by_rows_as_loaded")
    ax.plot([int(t) for t in rows], list(rows.values()), marker="o",
            label="engine (packed weights)" if loaded else None)  # fmt: skip
    if loaded:
        ax.plot([int(t) for t in loaded], list(loaded.values()), marker="o",
                label="weights as loaded")  # fmt: skip
    ax.set(title="target forward + LM head, batch 1", xlabel="tree nodes (rows)",
           ylabel="ms", ylim=(0, None))  # fmt: skip


def _plot_breakdown(ax, drafters: dict, result: dict) -> None:
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
