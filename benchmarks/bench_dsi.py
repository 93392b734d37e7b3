"""DSI in real runs: non-SI, SI at its best lookahead, and DSI at the lookahead Equation 1 allows
and at what DSI chooses (dsi/mode.py: the simulator fed the measured cost of a forward by its
rows and how much slower a forward is beside the drafter; a lookahead, or no drafts where none
is expected to pay), all through the same target server processes, on held-out chat prompts
(greedy, batch 1), with the simulator's prediction (dsi/sim.py, fed the measured row costs,
drafter latency and acceptance) beside each. A setting runs in two phases: calibration (non-SI,
SI at every --si-lookaheads and DSI at lookahead 1 on every pool: they measure a forward by its
rows, the drafter, its acceptance and the forwards beside it), then the compared rows; within a
phase each prompt goes through every configuration in turn (rotated), so the machine's drift
hits all alike.

    python benchmarks/bench_dsi.py [--prompts 8] [--tokens 64] [--sections real emulated failure]
                                   [--target-ms 50] [--fractions 0.1 0.2] [--sp 1 2 3 4 5 6 7]
                                   [--si-lookaheads 1 2 3 4] [--tree 1] [--out results/dsi.json]

Sections:
- real: SmolLM2 target servers (one thread each) and the default drafter (the shipped SSM, then
  prompt lookup) on this machine's cores, SP 1 and 2.
- emulated: servers that answer the target's recorded greedy tokens after an emulated forward
  of --target-ms, and the real drafter's tokens with its latency padded to each --fractions of
  the target's: SP swept over --sp at lookahead 1 (the ceil(1/c) plateau; calibration rows), at
  Equation 1's lookahead and at the chosen one; SI at its best lookahead; non-SI.
- failure: speculation's failure region: a weak drafter (the target's first layer) padded to
  --failure-fraction of the target's latency, where SI is slower than non-SI and DSI is not.
Per row: ms/token after the first token, requests identical to incremental decoding, the
measured target forward, drafter level and acceptance (accepted / verification steps with a
draft; "chain", what the simulator is fed: see sim.chain_acceptance), the simulator's
prediction from them and its error, and the overheads: message passing per task (round trip minus the server's compute), preemptions and the wait for their answers,
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
from specinfer.dsi.mode import DSIMode, plan_lookahead, server_spec, time_row_costs  # noqa: E402
from specinfer.dsi.servers import TargetPool  # noqa: E402
from specinfer.dsi.sim import (  # noqa: E402
    RowCost,
    chain_acceptance,
    draw_correct,
    dsi,
    level_cost,
    level_width,
    min_lookahead,
    si,
)

HERE = Path(__file__).parent
SIM_RUNS = 300


def measure(engine, configs: list[dict], prompts, expected, params, emulated: bool) -> list[dict]:
    """Every configuration ({"mode", "pool", ...}) over every prompt: each prompt goes through
    all of them in turn, the order rotated from prompt to prompt, so the machine's drift (20-30%
    within minutes on these VMs) hits every configuration alike. The rows' measurements."""
    runs = [{"per_token": [], "identical": 0, "total": {}} for _ in configs]
    for p, (prompt, (ids, tokens)) in enumerate(zip(prompts, expected)):
        for j in range(len(configs)):
            c, run = configs[(p + j) % len(configs)], runs[(p + j) % len(configs)]
            if emulated:
                c["pool"].set_trace(ids + tokens)
            seq = engine.make_sequence(prompt, params)
            engine.add_sequence(seq)
            start = time.perf_counter()
            c["mode"].step(engine)
            elapsed = time.perf_counter() - start - seq.metrics["ttft_s"]
            run["per_token"].append(elapsed / max(1, len(seq.output_ids) - 1))
            run["identical"] += seq.output_ids == tokens
            for k, v in seq.metrics["dsi"].items():
                run["total"][k] = run["total"].get(k, 0) + v
    n = sum(len(t) for _, t in expected)
    return [_row(c, run, len(prompts), n) for c, run in zip(configs, runs)]


def _row(config: dict, run: dict, prompts: int, tokens: int) -> dict:
    total = run["total"]
    forwards = max(1, total["target_forwards"])
    return {
        "kind": config["kind"],
        "sp": config["sp"],
        "lookahead": config["lookahead"],
        "ms_per_token": 1000 * statistics.mean(run["per_token"]),
        "identical": f"{run['identical']}/{prompts}",
        "target_ms": 1000 * total["compute_s"] / max(1, total["compute_n"]),
        "target_rows": total["compute_rows"] / max(1, total["compute_n"]),
        "level_width": level_width(
            total["compute_rows"], total["compute_levels"], total["compute_n"]
        ),
        "drafter_ms": 1000 * total["draft_s"] / max(1, total["draft_calls"]),
        "acceptance": total["accepted"] / max(1, total["tested"]),
        "chain_acceptance": chain_acceptance(
            total["accepted"], total["accepted_main"], total["tested"]
        ),
        "message_ms_per_task": 1000 * total["message_s"] / forwards,
        "preemptions": total["preemptions"],
        "preempt_wait_ms": 1000 * total["preempt_wait_s"] / max(1, total["preemptions"]),
        "wasted_forwards_per_token": total["wasted_forwards"] / tokens,
        "drafter_idle_s": total["drafter_idle_s"],
        "target_idle_s": total["target_idle_s"],
        "target_forwards": total["target_forwards"],
        "blocks_verified": total["blocks_verified"],
    }


def predict(row: dict, cost: RowCost, width: float, drafter_ms: float, acceptance: float,
            tokens: int, rng) -> float:  # fmt: skip
    """The simulator's ms/token for the row's configuration, fed the section's measured row
    costs (`width` rows a drafted level), drafter latency and acceptance. The row costs are
    scaled to the forward the row itself measured (its mean against theirs at its mean rows):
    servers and the drafter sharing cores slow every forward, which the simulator does not
    model."""
    kind, sp, lookahead = row["kind"], row["sp"], row["lookahead"]
    scale = row["target_ms"] / cost(row["target_rows"]) if row["target_rows"] else 1.0
    scaled = level_cost(lambda rows: scale * cost(rows), width)
    if kind == "non-SI" or not lookahead:  # no drafts
        return scaled(1)
    d, runs = max(drafter_ms, 1e-3), []
    for _ in range(SIM_RUNS):
        correct = draw_correct(tokens, acceptance, rng)
        runs.append(si(tokens, scaled, d, correct, lookahead) if kind == "SI"
                    else dsi(tokens, scaled, d, correct, lookahead, sp).latency)  # fmt: skip
    return statistics.mean(runs) / tokens


def section(name: str, engine, pools: dict, prompts, expected, params, args, rng,
            emulated: bool, draft_s: float | None) -> list[dict]:  # fmt: skip
    """Rows of one setting. First non-SI, SI at each lookahead and DSI at lookahead 1 on each
    pool (they measure the target's forward by rows, the drafter, its acceptance, and how much
    slower a forward is beside the drafter); then, side by side: non-SI, the best SI, and DSI
    on each pool at Equation 1's lookahead and at what DSI chooses from those measurements
    (mode.plan_lookahead: a lookahead, or no drafts where none is expected to pay)."""

    def config(kind: str, sp: int, lookahead: int) -> dict:
        """lookahead 0: DSI without drafts (what DSI runs where drafting does not pay)."""
        mode = DSIMode(engine, pools[sp], lookahead=max(1, lookahead), draft_s=draft_s,
                       drafter=kind != "non-SI" and lookahead > 0, overlap=kind == "DSI")  # fmt: skip
        return {
            "kind": kind,
            "sp": sp,
            "lookahead": lookahead,
            "mode": mode,
            "pool": pools[sp],
            "label": "",
        }

    def run(configs: list[dict], phase: str) -> list[dict]:
        rows = measure(engine, configs, prompts, expected, params, emulated)
        for row, c in zip(rows, configs):
            row.update(section=name, phase=phase, lookahead_from=c["label"])
        return rows

    sps = sorted(pools)
    calibration = run([config("non-SI", 1, 1)] + [config("SI", 1, k) for k in args.si_lookaheads]
                      + [config("DSI", sp, 1) | {"label": "lookahead 1"} for sp in sps],
                      "calibration")  # fmt: skip
    si_rows = [r for r in calibration if r["kind"] == "SI"]
    best = min(si_rows, key=lambda r: r["ms_per_token"])
    width = statistics.mean(r["level_width"] for r in si_rows)  # a drafted level's rows
    drafter_ms, acceptance = best["drafter_ms"], best["chain_acceptance"]
    # A forward's cost by rows, timed as DSI times it, up to the longest block compared.
    ids, tokens = expected[0]
    if emulated:
        pools[1].set_trace(ids + tokens)
    timed = time_row_costs(pools[1], ids + tokens[:8], drafter_ms / 1000, sps, width)
    cost = RowCost({r: 1000 * timed(r) for r in timed.rows})
    configs = [config("non-SI", 1, 1), config("SI", 1, best["lookahead"])]
    for row in calibration[-len(sps) :]:  # DSI at lookahead 1: its forwards beside the drafter
        sp, contention = row["sp"], max(1.0, row["target_ms"] / cost(row["target_rows"]))
        chosen, pays = plan_lookahead(level_cost(cost, width), drafter_ms, sp, acceptance,
                                      contention)  # fmt: skip
        lookaheads = {"Equation 1": min_lookahead(cost(1), drafter_ms, sp),
                      "chosen": chosen if pays else 0}  # fmt: skip
        for k in sorted(set(lookaheads.values())):
            label = ", ".join(n for n, v in lookaheads.items() if v == k)
            configs.append(config("DSI", sp, k) | {"label": label})
    rows = run(configs, "compared")
    for row in calibration + rows:
        row["predicted_ms_per_token"] = predict(row, cost, width, drafter_ms, acceptance,
                                                args.tokens - 1, rng)  # fmt: skip
        row["prediction_error"] = row["ms_per_token"] / row["predicted_ms_per_token"] - 1
        row["best_si"] = row is best or (row["kind"] == "SI" and row["phase"] == "compared")
    for row in calibration[-len(sps) :] + rows:
        print(f"[{name}] {row['kind']:7} SP={row['sp']} L={row['lookahead']:2} "
              f"{row['lookahead_from']:24}: {row['ms_per_token']:6.1f} ms/token (predicted "
              f"{row['predicted_ms_per_token']:6.1f}, {row['prediction_error']:+.0%}) identical "
              f"{row['identical']}, target {row['target_ms']:.1f} ms, drafter "
              f"{row['drafter_ms']:.2f} ms, acceptance {row['acceptance']:.2f} (chain "
              f"{row['chain_acceptance']:.2f}), wasted "
              f"{row['wasted_forwards_per_token']:.2f}/token", flush=True)  # fmt: skip
    row_costs = {round(r, 1): round(cost(r), 1) for r in cost.rows}
    print(f"[{name}] target ms by rows {row_costs} ({width:.1f} rows a level), drafter "
          f"{drafter_ms:.2f} ms, acceptance {acceptance:.2f}", flush=True)  # fmt: skip
    return calibration + rows


def expected_tokens(args, prompts, params) -> list[tuple[list[int], list[int]]]:
    with Engine(args.model, dtype=args.dtype, threads=args.threads, max_batch_size=1) as engine:
        outs = engine.generate(prompts, params)
        return [(engine.prompt_ids(p), o.token_ids) for p, o in zip(prompts, outs)]


def drafter_engine(args, ssm):
    return Engine(args.model, dtype=args.dtype, threads=1, ssm=ssm, tree=args.tree,
                  adaptive_tree=False, max_batch_size=1)  # fmt: skip


def pools_for(engine, sps: list[int], latency_s: float | None) -> dict[int, TargetPool]:
    return {sp: TargetPool(server_spec(engine, 1, latency_s), sp) for sp in sps}


def draw(result: dict, plt):
    rows = [r for r in result["rows"]
            if r.get("phase") == "compared" or r.get("lookahead_from") == "lookahead 1"]  # fmt: skip
    names = list(dict.fromkeys(r["section"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["section"] == name]
        for label in ("Equation 1", "chosen", "lookahead 1"):
            group = sorted((r for r in mine if label in r["lookahead_from"]), key=lambda r: r["sp"])
            if group:
                ax.plot([r["sp"] for r in group], [r["ms_per_token"] for r in group], marker="o",
                        label=f"DSI, {label}")  # fmt: skip
                ax.plot([r["sp"] for r in group], [r["predicted_ms_per_token"] for r in group],
                        ls=":", color="gray")  # fmt: skip
        for r in mine:
            if r["kind"] != "DSI":
                ax.axhline(r["ms_per_token"], ls="--",
                           label=f"SI (L={r['lookahead']})" if r["kind"] == "SI" else "non-SI",
                           color="C3" if r["kind"] == "SI" else "C4")  # fmt: skip
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
    ap.add_argument("--tree", default="1", help="the SSM's tree; DSI drafts one level at a "
                    "time, so its first width is the SSM's candidates per level (prompt "
                    "lookup adds its own)")  # fmt: skip
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
                rows += section(
                    label,
                    engine,
                    {sp: pools[sp] for sp in sorted(set(sps))} | {1: pools[1]},
                    prompts,
                    expected,
                    params,
                    args,
                    rng,
                    emulated,
                    draft_s,
                )
        finally:
            for pool in pools.values():
                pool.close()
            engine.close()
    result = {"settings": {**vars(args), "wall_s": time.time() - started}, "rows": rows}
    save(result, args.out, draw)


if __name__ == "__main__":
    main()
