"""DSI in real runs: non-SI, SI at its best lookahead and DSI at the lookahead Equation 1 allows,
all through the same target server processes, on held-out chat prompts (greedy, batch 1), with
the simulator's prediction (dsi/sim.py, fed the measured latencies and acceptance) beside each.

    python benchmarks/bench_dsi.py [--prompts 8] [--tokens 64] [--sections real emulated failure]
                                   [--target-ms 50] [--fractions 0.1 0.2] [--sp 1 2 3 4 5 6 7]
                                   [--si-lookaheads 1 2 3 4] [--out results/dsi.json]

Sections:
- real: SmolLM2 target servers (one thread each) and the default drafter (the shipped SSM, then
  prompt lookup) on this machine's cores, SP 1 and 2.
- emulated: servers that answer the target's recorded greedy tokens after an emulated forward
  of --target-ms, and the real drafter's tokens with its latency padded to each --fractions of
  the target's: SP swept over --sp at lookahead 1 (the ceil(1/c) plateau) and at Equation 1's
  lookahead; SI at its best lookahead; non-SI.
- failure: speculation's failure region: a weak drafter (the target's first layer) padded to
  --failure-fraction of the target's latency, where SI is slower than non-SI and DSI is not.
Per row: ms/token after the first token, requests identical to incremental decoding, the
measured target forward, drafter level and acceptance (accepted / verification steps with a
draft), the simulator's prediction from them and its error, and the overheads: message passing
per task (round trip minus the server's compute), preemptions and the wait for their answers,
wasted forwards per token, drafter idle and target idle. JSON + PNG.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import load_prompts  # noqa: E402
from results_io import save  # noqa: E402
from specinfer import Engine, SamplingParams  # noqa: E402
from specinfer.dsi.mode import DSIMode, server_spec  # noqa: E402
from specinfer.dsi.orchestrator import choose_lookahead  # noqa: E402
from specinfer.dsi.servers import TargetPool  # noqa: E402
from specinfer.dsi.sim import draw_correct, dsi, si  # noqa: E402

HERE = Path(__file__).parent
SIM_RUNS = 300


def measure(engine, mode: DSIMode, prompts, expected, pool, params, emulated: bool) -> dict:
    """Run every prompt through `mode`; the row's measurements."""
    total = {}
    per_token, identical = [], 0
    for prompt, (ids, tokens) in zip(prompts, expected):
        if emulated:
            pool.set_trace(ids + tokens)
        seq = engine.make_sequence(prompt, params)
        engine.add_sequence(seq)
        start = time.perf_counter()
        mode.step(engine)
        end = time.perf_counter()
        n = len(seq.output_ids)
        per_token.append((end - start - seq.metrics["ttft_s"]) / max(1, n - 1))
        identical += seq.output_ids == tokens
        for k, v in seq.metrics["dsi"].items():
            total[k] = total.get(k, 0) + v
    tokens = sum(len(t) for _, t in expected)
    forwards = max(1, total["target_forwards"])
    return {
        "ms_per_token": 1000 * statistics.mean(per_token),
        "identical": f"{identical}/{len(prompts)}",
        "target_ms": 1000 * total["compute_s"] / max(1, total["compute_n"]),
        "drafter_ms": 1000 * total["draft_s"] / max(1, total["draft_calls"]),
        "acceptance": total["accepted"] / max(1, total["tested"]),
        "message_ms_per_task": 1000 * total["message_s"] / forwards,
        "preemptions": total["preemptions"],
        "preempt_wait_ms": 1000 * total["preempt_wait_s"] / max(1, total["preemptions"]),
        "wasted_forwards_per_token": total["wasted_forwards"] / tokens,
        "drafter_idle_s": total["drafter_idle_s"],
        "target_idle_s": total["target_idle_s"],
        "target_forwards": total["target_forwards"],
        "blocks_verified": total["blocks_verified"],
    }


def predict(row: dict, kind: str, tokens: int, sp: int, lookahead: int, rng) -> float:
    """The simulator's ms/token for the row's measured latencies and acceptance."""
    t, d, acc = row["target_ms"], max(row["drafter_ms"], 1e-3), row["acceptance"]
    if kind == "non-SI":
        return t
    runs = []
    for _ in range(SIM_RUNS):
        correct = draw_correct(tokens, acc, rng)
        runs.append(si(tokens, t, d, correct, lookahead) if kind == "SI"
                    else dsi(tokens, t, d, correct, lookahead, sp).latency)  # fmt: skip
    return statistics.mean(runs) / tokens


def section(name: str, engine, pools: dict, prompts, expected, params, args, rng,
            emulated: bool, draft_s: float | None, sweep: bool) -> list[dict]:  # fmt: skip
    """Rows of one setting: non-SI and SI on one server, DSI on each pool."""
    rows = []

    def add(kind: str, sp: int, lookahead: int, mode: DSIMode, pool) -> dict:
        row = measure(engine, mode, prompts, expected, pool, params, emulated)
        row.update(section=name, kind=kind, sp=sp, lookahead=lookahead)
        row["predicted_ms_per_token"] = predict(row, kind, args.tokens - 1, sp, lookahead, rng)
        row["prediction_error"] = row["ms_per_token"] / row["predicted_ms_per_token"] - 1
        rows.append(row)
        print(f"[{name}] {kind:7} SP={sp} L={lookahead:2}: {row['ms_per_token']:6.1f} ms/token "
              f"(predicted {row['predicted_ms_per_token']:6.1f}, {row['prediction_error']:+.0%}) "
              f"identical {row['identical']}, target {row['target_ms']:.1f} ms, drafter "
              f"{row['drafter_ms']:.2f} ms, acceptance {row['acceptance']:.2f}, wasted "
              f"{row['wasted_forwards_per_token']:.2f}/token", flush=True)  # fmt: skip
        return row

    one = pools[min(pools)]
    add("non-SI", 1, 1, DSIMode(engine, one, lookahead=1, drafter=False), one)
    si_rows = [add("SI", 1, k, DSIMode(engine, one, lookahead=k, overlap=False, draft_s=draft_s), one)
               for k in args.si_lookaheads]  # fmt: skip
    best = min(si_rows, key=lambda r: r["ms_per_token"])
    best["best_si"] = True
    target_ms, drafter_ms = best["target_ms"], best["drafter_ms"]
    for sp, pool in sorted(pools.items()):
        lookahead = choose_lookahead(target_ms, drafter_ms, sp)
        add("DSI", sp, lookahead, DSIMode(engine, pool, lookahead=lookahead, draft_s=draft_s), pool)
        if sweep and lookahead != 1:
            add("DSI", sp, 1, DSIMode(engine, pool, lookahead=1, draft_s=draft_s), pool)
    return rows


def expected_tokens(args, prompts, params) -> list[tuple[list[int], list[int]]]:
    with Engine(args.model, dtype=args.dtype, threads=args.threads, max_batch_size=1) as engine:
        outs = engine.generate(prompts, params)
        return [(engine.prompt_ids(p), o.token_ids) for p, o in zip(prompts, outs)]


def drafter_engine(args, ssm):
    return Engine(args.model, dtype=args.dtype, threads=1, ssm=ssm, tree="1",
                  adaptive_tree=False, max_batch_size=1)  # fmt: skip


def pools_for(engine, sps: list[int], latency_s: float | None) -> dict[int, TargetPool]:
    return {sp: TargetPool(server_spec(engine, 1, latency_s), sp) for sp in sps}


def draw(result: dict, plt):
    rows = result["rows"]
    names = list(dict.fromkeys(r["section"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["section"] == name]
        for kind, marker in (("DSI", "o"), ("SI", "s"), ("non-SI", "^")):
            pts = [r for r in mine if r["kind"] == kind and (kind != "SI" or r.get("best_si"))]
            if kind == "DSI":
                by_l = {}
                for r in pts:
                    eq1 = r["lookahead"] != 1 or all(
                        x["lookahead"] == 1 for x in pts if x["sp"] == r["sp"]
                    )
                    by_l.setdefault("Eq. 1 lookahead" if eq1 else "lookahead 1", []).append(r)
                for label, group in by_l.items():
                    group.sort(key=lambda r: r["sp"])
                    ax.plot([r["sp"] for r in group], [r["ms_per_token"] for r in group],
                            marker=marker, label=f"DSI, {label}")  # fmt: skip
                    ax.plot([r["sp"] for r in group], [r["predicted_ms_per_token"] for r in group],
                            ls=":", color="gray")  # fmt: skip
            else:
                for r in pts:
                    ax.axhline(r["ms_per_token"], ls="--", marker=None,
                               label=f"{kind} (L={r['lookahead']})" if kind == "SI" else kind,
                               color="C1" if kind == "SI" else "C2")  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("target servers (SP)")
        ax.set_ylabel("ms / token")
        ax.legend(fontsize=7)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="for the incremental reference")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file", default=str(HERE / "data" / "held_out.jsonl"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sections", nargs="+", default=["real", "emulated", "failure"])
    ap.add_argument("--real-sp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--si-lookaheads", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--failure-fraction", type=float, default=0.8)
    ap.add_argument("--failure-sp", type=int, nargs="+", default=[2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "dsi.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = load_prompts(args.prompts, args.prompts_file, chat=True)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    expected = expected_tokens(args, prompts, params)
    rows, started = [], time.time()
    for name in args.sections:
        emulated = name != "real"
        ssm = [1] if name == "failure" else ["ngram", "default"]
        engine = drafter_engine(args, ssm)
        target_s = args.target_ms / 1000 if emulated else None
        sps = {"real": args.real_sp, "failure": args.failure_sp}.get(name, args.sp)
        pools = pools_for(engine, sorted(set(sps) | {1}), target_s)
        try:
            fractions = [args.failure_fraction] if name == "failure" else args.fractions
            for c in fractions if emulated else [None]:
                label = name if c is None else f"{name} (drafter at {c:.0%} of target)"
                draft_s = None if c is None else c * target_s
                rows += section(label, engine, {sp: pools[sp] for sp in sorted(set(sps))} | {1: pools[1]},
                                prompts, expected, params, args, rng, emulated, draft_s,
                                sweep=name == "emulated")  # fmt: skip
        finally:
            for pool in pools.values():
                pool.close()
            engine.close()
    result = {"settings": {**vars(args), "wall_s": time.time() - started}, "rows": rows}
    save(result, args.out, draw)


if __name__ == "__main__":
    main()
