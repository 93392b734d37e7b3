"""DSI's offline analysis (the DSI paper's Figure 2): expected latency of non-SI, SI and DSI over
drafter latency (a fraction of the target's) x acceptance rate, as heatmaps, with Theorem 1
(DSI is never slower than non-SI) checked on every simulated run of the grid.

    python benchmarks/dsi_sim.py [--tokens 50] [--runs 100] [--sp 7] [--si-lookaheads 1 5 10]
                                 [--predict TARGET_MS DRAFTER_MS ACCEPTANCE] [--out ...]

Per grid point: --runs draws of which drafts are right (i.i.d. with the acceptance rate, the
same draws for SI and DSI), SI at its best lookahead among --si-lookaheads, DSI at the smallest
lookahead Equation 1 allows with --sp target servers (python/specinfer/dsi/sim.py says what is
simulated). Panels: SI vs non-SI (below 1: where speculation slows decoding down), DSI vs SI,
DSI vs non-SI. --predict prints the model's prediction for one measured configuration (latencies
of a target and a drafter forward, the drafter's acceptance rate). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from results_io import save  # noqa: E402
from specinfer.dsi.sim import draw_correct, dsi, min_lookahead, non_si, si  # noqa: E402

HERE = Path(__file__).parent


def point(tokens: int, target_s: float, drafter_s: float, acceptance: float, runs: int, sp: int,
          si_lookaheads: list[int], rng: random.Random) -> dict:  # fmt: skip
    lookahead = min_lookahead(target_s, drafter_s, sp)
    si_by = {k: [] for k in si_lookaheads}
    dsi_runs, slower = [], 0
    for _ in range(runs):
        correct = draw_correct(tokens, acceptance, rng)
        for k in si_lookaheads:
            si_by[k].append(si(tokens, target_s, drafter_s, correct, k))
        run = dsi(tokens, target_s, drafter_s, correct, lookahead, sp)
        dsi_runs.append(run)
        slower += run.latency > non_si(tokens, target_s) * (1 + 1e-9)
    best_k = min(si_lookaheads, key=lambda k: statistics.mean(si_by[k]))
    return {
        "drafter_fraction": drafter_s / target_s,
        "acceptance": acceptance,
        "non_si": non_si(tokens, target_s),
        "si": statistics.mean(si_by[best_k]),
        "si_lookahead": best_k,
        "dsi": statistics.mean(r.latency for r in dsi_runs),
        "dsi_lookahead": lookahead,
        "dsi_wasted_forwards": statistics.mean(r.wasted for r in dsi_runs),
        "dsi_target_forwards": statistics.mean(r.target_forwards for r in dsi_runs),
        "dsi_runs_slower_than_non_si": slower,
    }


def draw(result: dict, plt):
    import numpy as np

    s = result["settings"]
    fractions, rates = s["drafter_fractions"], s["acceptances"]
    grid = {(p["drafter_fraction"], p["acceptance"]): p for p in result["points"]}
    panels = [("SI / non-SI speedup", lambda p: p["non_si"] / p["si"]),
              ("DSI / SI speedup", lambda p: p["si"] / p["dsi"]),
              ("DSI / non-SI speedup", lambda p: p["non_si"] / p["dsi"])]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (title, value) in zip(axes, panels):
        z = np.array([[value(grid[(f, a)]) for f in fractions] for a in rates])
        im = ax.imshow(z, origin="lower", aspect="auto", cmap="RdYlGn", vmin=0.5, vmax=2.0,
                       extent=(fractions[0], fractions[-1], rates[0], rates[-1]))  # fmt: skip
        ax.contour(np.array(fractions), np.array(rates), z, levels=[1.0], colors="k")
        ax.set(title=title, xlabel="drafter latency / target latency", ylabel="acceptance rate")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"DSI offline simulation: {s['tokens']} tokens, SP={s['sp']}, "
                 f"{s['runs']} runs a point; black line: speedup 1")  # fmt: skip
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--sp", type=int, default=7, help="target servers (SP degree)")
    ap.add_argument("--si-lookaheads", type=int, nargs="+", default=[1, 5, 10])
    ap.add_argument("--steps", type=int, default=20, help="grid points per axis")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predict", type=float, nargs=3, metavar=("TARGET_MS", "DRAFTER_MS", "ACC"))
    ap.add_argument("--out", default=str(HERE / "results" / "dsi_sim.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.predict:
        target_ms, drafter_ms, acceptance = args.predict
        p = point(args.tokens, target_ms, drafter_ms, acceptance, args.runs, args.sp,
                  args.si_lookaheads, rng)  # fmt: skip
        print(f"predicted ms/token: non-SI {p['non_si'] / args.tokens:.1f}, SI (lookahead "
              f"{p['si_lookahead']}) {p['si'] / args.tokens:.1f}, DSI (lookahead "
              f"{p['dsi_lookahead']}, SP {args.sp}) {p['dsi'] / args.tokens:.1f}")  # fmt: skip
        return
    fractions = [round((i + 1) / args.steps, 4) for i in range(args.steps)]
    rates = [round(i / args.steps, 4) for i in range(args.steps)]
    points = [point(args.tokens, 1.0, f, a, args.runs, args.sp, args.si_lookaheads, rng)
              for a in rates for f in fractions]  # fmt: skip
    slower = sum(p["dsi_runs_slower_than_non_si"] for p in points)
    si_fails = [p for p in points if p["si"] > p["non_si"]]
    print(f"{len(points)} grid points x {args.runs} runs: DSI slower than non-SI in {slower} "
          f"runs (Theorem 1: 0); DSI slower than SI in expectation at "
          f"{sum(p['dsi'] > p['si'] * (1 + 1e-9) for p in points)} points; SI slower than "
          f"non-SI at {len(si_fails)} points, DSI at "
          f"{sum(p['dsi'] > p['non_si'] * (1 + 1e-9) for p in si_fails)} of those")  # fmt: skip
    best = max(points, key=lambda p: p["si"] / p["dsi"])
    print(f"largest DSI/SI speedup {best['si'] / best['dsi']:.2f}x at drafter "
          f"{best['drafter_fraction']:.2f}, acceptance {best['acceptance']:.2f}")  # fmt: skip
    settings = {"tokens": args.tokens, "runs": args.runs, "sp": args.sp, "seed": args.seed,
                "si_lookaheads": args.si_lookaheads, "drafter_fractions": fractions,
                "acceptances": rates, "dsi_runs_slower_than_non_si": slower}  # fmt: skip
    save({"settings": settings, "points": points}, args.out, draw)


if __name__ == "__main__":
    main()
