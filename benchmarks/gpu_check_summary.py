"""Summarises a gpu_check.sh run: achieved bandwidth of each CUDA microbenchmark (Google Benchmark
JSON) and of the tree-attention vs SDPA comparison, as a fraction of the device's peak, into one
table on stdout and one JSON file. Needs only the standard library.

    python3 benchmarks/gpu_check_summary.py --bench bench_cuda.json --sdpa sdpa.json \
        --out summary.json
"""

from __future__ import annotations

import argparse
import json
import os

# The headline shape: Llama-7B heads, batch 16, prefix 2048, a 20-node tree.
HEADLINE = "BM_TreeAttentionCuda/hq:32/hkv:32/d:128/prefix:2048/tree:20/batch:16/"


def load(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:  # e.g. the benchmark crashed while writing it
            print(f"gpu_check_summary: {path} is not valid JSON ({e}); left out")
            return None


def bench_rows(bench: dict) -> list[dict]:
    rows = []
    for b in bench.get("benchmarks", []):
        if b.get("error_occurred"):
            rows.append(dict(name=b["name"], error=b.get("error_message", "error")))
            continue
        rows.append(
            dict(
                name=b["name"],
                time_us=b["real_time"],
                gb_per_s=b["bytes_per_s"] / 1e9,
                peak_frac=b["peak_frac"],
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", help="bench_kernels_cuda --benchmark_out JSON")
    parser.add_argument("--sdpa", help="bench_sdpa_gpu.py JSON")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bench, sdpa = load(args.bench), load(args.sdpa)
    summary: dict = dict(peak_gb_per_s=None, microbenchmarks=[], sdpa=[])

    if bench is not None:
        context = bench.get("context", {})
        peak = float(context["peak_bytes_per_s"]) if "peak_bytes_per_s" in context else None
        summary.update(device=context.get("cuda_device"), peak_gb_per_s=peak and peak / 1e9)
        summary["microbenchmarks"] = rows = bench_rows(bench)
        print(f"device: {summary['device']}, peak {summary['peak_gb_per_s'] or 0:.0f} GB/s")
        print(f"{'benchmark':<84} {'us':>9} {'GB/s':>7} {'of peak':>7}")
        for r in rows:
            if "error" in r:
                print(f"{r['name']:<84} {r['error']}")
            else:
                print(
                    f"{r['name']:<84} {r['time_us']:9.1f} {r['gb_per_s']:7.0f} "
                    f"{r['peak_frac']:7.1%}"
                )
        headline = [r for r in rows if r["name"].startswith(HEADLINE) and "error" not in r]
        if headline:
            summary["headline_peak_frac"] = headline[0]["peak_frac"]
            print(
                f"headline (Llama-7B, batch 16, prefix 2048, tree 20): {headline[0]['peak_frac']:.1%} of peak"
            )

    if sdpa is not None:
        peak = summary["peak_gb_per_s"]
        for r in sdpa["results"]:
            summary["sdpa"].append(
                dict(r, ours_peak_frac=peak and r["ours_bytes_per_s"] / 1e9 / peak)
            )
        wins = sum(r["speedup"] > 1.0 for r in sdpa["results"])
        summary["sdpa_wins"] = f"{wins}/{len(sdpa['results'])}"
        print(f"tree_attention beats SDPA with an explicit mask on {summary['sdpa_wins']} shapes")

    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    if any("error" in r for r in summary["microbenchmarks"]):
        raise SystemExit("gpu_check_summary: some microbenchmarks failed (see above)")


if __name__ == "__main__":
    main()
