"""Offloading on this machine: ms/token of the default model with resident weights and with its
layers streamed from disk each forward (offload="disk"), incremental and speculative, in one run.

    python benchmarks/bench_offload.py [--prompts 8] [--tokens 64] [--trees 2,2,2,1,1,1,1,1]
                                       [--drafting default+ngram feature+ngram] [--device cpu] [--dtype bfloat16] [--threads 2]
                                       [--out results/offload.json]

Every configuration has its own engine, all open at once (each warmed up on the first prompt);
the held-out chat prompts go one at a time (batch 1, greedy) through every configuration in
turn, the order rotated each prompt, so the drift of a shared disk's speed hits all alike:
resident and disk-offloaded, incremental, speculative with the default
drafting (the shipped SSM + prompt lookup, tree sized by the cost model), with each other
--drafting (drafters joined by "+", merged into one tree, sized the same way) and with each
--trees config (the default drafting's whole trees). Bytes streamed per generated token are the layer bytes of every target
forward (prefill included) over the tokens generated; the disk's read bandwidth is measured by
itself (O_DIRECT reads of the layer file, nothing else running) and as the reader thread saw
it while decoding. With --device cuda the offloaded rows are offload="cpu" (pinned host memory
to the GPU) and offload="disk". Every configuration's tokens are compared with resident
incremental decoding (they must be identical). An offloaded configuration's speed-up over
offloaded incremental decoding is given over all prompts and, as min / median / max, per prompt
(the two ran close together in time): a shared disk's speed drifts enough to move it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import load_prompts  # noqa: E402
from results_io import save  # noqa: E402
from specinfer import Engine, SamplingParams  # noqa: E402
from specinfer.offload import DiskReader, aligned_buffer  # noqa: E402

HERE = Path(__file__).parent


def disk_bandwidth(path: Path, stride: int, seconds: float = 3.0) -> float:
    """Bytes/s of O_DIRECT layer reads of the file, back to back."""
    reader = DiskReader(path, stride)
    buffer = aligned_buffer(stride, torch.device("cpu"))
    layers = path.stat().st_size // stride
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        reader.read(done % layers, buffer)
        done += 1
    elapsed = time.perf_counter() - start
    reader.close()
    return done * stride / elapsed


def open_engine(args, stack: ExitStack, kwargs: dict, warm_up: str, params) -> Engine:
    """An engine for one configuration, warmed up (graphs, costs, the layer file)."""
    engine = stack.enter_context(Engine(args.model, dtype=args.dtype, device=args.device,
                                        threads=args.threads, max_batch_size=1, **kwargs))  # fmt: skip
    engine.generate(warm_up, params)
    return engine


def row(name: str, kwargs: dict, engine: Engine, outs: list, read0: tuple) -> dict:
    """The configuration's numbers over its outputs (in prompt order)."""
    streamer = engine.runner.streamer
    reads = (streamer.bytes - read0[0], streamer.read_s - read0[1]) if streamer else (0, 0)
    tokens = sum(len(o.token_ids) for o in outs)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    steps = sum(o.metrics["steps"] for o in outs)
    return {
        "name": name,
        "offload": kwargs.get("offload"),
        "mode": kwargs.get("mode", "speculative"),
        "ssm": kwargs.get("ssm"),
        "tree": kwargs.get("tree"),
        "ms_per_token": 1000 * sum(o.metrics["decode_s"] for o in outs) / decoded,
        "ms_per_token_by_prompt": [
            1000 * o.metrics["decode_s"] / (len(o.token_ids) - 1) for o in outs
        ],
        "tokens_per_step": decoded / steps,
        "tree_nodes_per_step": sum(o.metrics["tree_nodes"] for o in outs) / steps,
        "ssm_ms_per_step": 1000 * sum(o.metrics["ssm_s"] for o in outs) / steps,
        "target_ms_per_step": 1000 * sum(o.metrics["target_s"] for o in outs) / steps,
        "weight_bytes_per_token": sum(o.metrics["weight_bytes"] for o in outs) / tokens,
        "stream_wait_ms_per_step": 1000 * sum(o.metrics["stream_wait_s"] for o in outs) / steps,
        "layer_bytes": streamer.layer_bytes if streamer else 0,
        "reader_bytes_per_s": reads[0] / reads[1] if reads[1] else None,
        "token_ids": [o.token_ids for o in outs],
    }


def draw(result: dict, plt):
    rows = result["runs"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [r["name"].replace(" ", "\n") for r in rows]  # long names overlap on one line
    colors = ["tab:blue" if r["offload"] is None else "tab:orange" for r in rows]
    bars = ax.bar(range(len(rows)), [r["ms_per_token"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r['tokens_per_step']:.2f} tok/step", ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms per token (batch 1)")
    ax.set_title("resident (blue) vs offloaded (orange)")
    off = [r for r in rows if r["offload"]]
    bx.bar(range(len(off)), [r["weight_bytes_per_token"] / 1e6 for r in off], color="tab:orange")
    bx.set_xticks(range(len(off)), [r["name"].replace(" ", "\n") for r in off], fontsize=7)
    bx.set_ylabel("MB of weights streamed per generated token")
    s = result["settings"]
    bx.set_title(f"disk: {s['disk_mb_per_s']:.0f} MB/s O_DIRECT")
    fig.suptitle(f"offloading, {s['dtype']}, {s['threads']} threads, {s['device']}")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trees", nargs="*", default=["2,2,2,1,1,1,1,1"],
                    help="larger trees to run whole under offloading")  # fmt: skip
    ap.add_argument("--ssm", default="default+ngram",
                    help="the default drafting: drafters joined by '+' (another model than the "
                         "default needs its own, e.g. layers:4+ngram)")  # fmt: skip
    ap.add_argument("--drafting", nargs="*", default=[],
                    help="more drafter sets, each drafters joined by '+' (e.g. default+feature+ngram)")  # fmt: skip
    ap.add_argument("--offload-dir", default=None, help="(default: a temporary folder)")
    ap.add_argument("--prompts-file", default=str(HERE / "data" / "held_out.jsonl"))
    ap.add_argument("--out", default=str(HERE / "results" / "offload.json"))
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, args.prompts_file, chat=True)
    spec = {"ssm": args.ssm.split("+")}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    modes = ["cpu", "disk"] if args.device.startswith("cuda") else ["disk"]
    with tempfile.TemporaryDirectory(prefix="specinfer-offload-") as tmp:
        folder = args.offload_dir or tmp
        drafting = [("", spec)] + [(f" {d}", {"ssm": d.split("+")}) for d in args.drafting]
        plan = [("resident incremental", {"mode": "incremental"})]
        plan += [(f"resident speculative{name}", ssm) for name, ssm in drafting]
        for mode in modes:
            off = {"offload": mode, "offload_dir": folder}
            plan += [(f"{mode} incremental", {"mode": "incremental", **off})]
            plan += [(f"{mode} speculative{name}", {**ssm, **off}) for name, ssm in drafting]
            plan += [(f"{mode} tree {t}", {**spec, **off, "tree": t, "adaptive_tree": False})
                     for t in args.trees]  # fmt: skip
        with ExitStack() as stack:
            engines = [open_engine(args, stack, kwargs, prompts[0], params)
                       for _, kwargs in tqdm(plan, desc="engines")]  # fmt: skip
            reads0 = [(e.runner.streamer.bytes, e.runner.streamer.read_s) if e.runner.streamer
                      else (0, 0.0) for e in engines]  # fmt: skip
            outs = [[] for _ in plan]
            # Prompt by prompt through every configuration, the order rotated each prompt: a
            # shared disk's or CPU's speed drifts by tens of percent over minutes, and this way
            # the drift hits every configuration alike.
            for p, prompt in enumerate(tqdm(prompts, desc="prompts")):
                for i in range(len(plan)):
                    c = (p + i) % len(plan)
                    outs[c].append(engines[c].generate(prompt, params)[0])
            runs = [row(name, kwargs, e, o, r0)
                    for (name, kwargs), e, o, r0 in zip(plan, engines, outs, reads0)]  # fmt: skip
            files = [e.runner.streamer for e in engines if e.runner.streamer]
            layer_file = next(((f.path, f.layout.stride) for f in files if f.path), None)
            for r in runs:
                mbps = (
                    f"{r['reader_bytes_per_s'] / 1e6:5.0f}" if r["reader_bytes_per_s"] else "    -"
                )
                print(f"{r['name']:28s}: {r['ms_per_token']:6.1f} ms/token, "
                      f"{r['tokens_per_step']:.2f} tokens/step, "
                      f"{r['weight_bytes_per_token'] / 1e6:6.1f} MB/token streamed (reader {mbps} "
                      f"MB/s), ssm {r['ssm_ms_per_step']:.0f} + target "
                      f"{r['target_ms_per_step']:.0f} ms/step", flush=True)  # fmt: skip
        bandwidth = disk_bandwidth(*layer_file) if layer_file else None
    reference = runs[0]["token_ids"]
    for r in runs:
        r["identical_to_resident"] = sum(a == b for a, b in zip(r["token_ids"], reference))
        del r["token_ids"]
    print(f"disk read bandwidth (O_DIRECT, alone): {bandwidth / 1e6:.0f} MB/s")
    for mode in modes:
        inc = next(r for r in runs if r["name"] == f"{mode} incremental")
        for r in runs:
            if r["offload"] == mode and r is not inc:
                r["speedup_vs_incremental"] = inc["ms_per_token"] / r["ms_per_token"]
                # Per prompt, the two ran a few minutes apart at most: the spread shows how much
                # the disk's drift moves the ratio.
                ratios = sorted(a / b for a, b in zip(inc["ms_per_token_by_prompt"],
                                                      r["ms_per_token_by_prompt"]))  # fmt: skip
                by = {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
                r["speedup_by_prompt"] = by
                r["bytes_reduction"] = inc["weight_bytes_per_token"] / r["weight_bytes_per_token"]
                print(f"{r['name']:28s}: {r['speedup_vs_incremental']:.2f}x faster per token than "
                      f"{mode} incremental; {r['bytes_reduction']:.2f}x fewer bytes per token "
                      f"({r['tokens_per_step']:.2f} tokens/step); per prompt {by['min']:.2f}x to "
                      f"{by['max']:.2f}x, median {by['median']:.2f}x")  # fmt: skip
    for r in runs:
        print(f"{r['name']:28s}: {r['identical_to_resident']}/{len(prompts)} outputs identical "
              "to resident incremental")  # fmt: skip
    settings = {"model": args.model, "dtype": args.dtype, "device": args.device,
                "threads": args.threads, "prompts": len(prompts), "tokens": args.tokens,
                "cores": os.cpu_count(), "torch": torch.__version__,
                "disk_mb_per_s": bandwidth / 1e6 if bandwidth else None}  # fmt: skip
    save({"settings": settings, "runs": runs}, args.out, draw)


if __name__ == "__main__":
    main()
