"""The README's main command end to end, as a user waits for it: `specinfer generate PROMPT` in a
new process each run, wall seconds from start to exit (import, load, generation). Configurations
alternate run by run in one invocation, so the machine's drift touches them alike.

    python benchmarks/bench_cli.py [--runs 5] [--prompt "Write a haiku about the sea"]
        [--config NAME "ENV=VALUE ... -- EXTRA ARGS"]...

Default configurations: the GGUF file read directly at every load (SPECINFER_GGUF_CACHE=0) and
read from its conversion (a cache directory of this run, converted before the first timed run);
each with speculation (the default drafting) and with --mode incremental.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from results_io import save

DEFAULT_PROMPT = "Write a haiku about the sea"


def parse_config(spec: str, cache: str) -> tuple[dict, list[str]]:
    """'ENV=VALUE ... -- ARGS' as (environment additions, generate arguments); CACHE in a value
    stands for this run's conversion directory."""
    env_part, _, args_part = spec.partition("--")
    env = dict(item.split("=", 1) for item in shlex.split(env_part))
    return {k: v.replace("CACHE", cache) for k, v in env.items()}, shlex.split(args_part)


def run_once(prompt: str, env: dict, args: list[str], threads: int) -> float:
    command = [sys.executable, "-m", "specinfer.cli", "generate", prompt,
               "--threads", str(threads), *args]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", nargs=2, action="append", metavar=("NAME", "SPEC"),
                        help="'ENV=VALUE ... -- generate arguments' (CACHE: this run's cache)")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/cli.json")
    args = parser.parse_args()
    configs = args.config or [
        ("gguf_read_each_time", "SPECINFER_GGUF_CACHE=0 --"),
        ("gguf_converted", "SPECINFER_GGUF_CACHE=CACHE --"),
        ("gguf_read_each_time_incremental", "SPECINFER_GGUF_CACHE=0 -- --mode incremental"),
        ("gguf_converted_incremental", "SPECINFER_GGUF_CACHE=CACHE -- --mode incremental"),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as cache:
        parsed = {name: parse_config(spec, cache) for name, spec in configs}
        # A first run per configuration, untimed: converts where a configuration caches, and
        # brings the files into the page cache for all.
        first = {name: run_once(args.prompt, *parsed[name], args.threads) for name in parsed}
        walls = {name: [] for name in parsed}
        for r in range(args.runs):
            for name in list(parsed)[r % len(parsed) :] + list(parsed)[: r % len(parsed)]:
                walls[name].append(run_once(args.prompt, *parsed[name], args.threads))
                print(f"run {r + 1}/{args.runs} {name}: {walls[name][-1]:.2f} s", flush=True)
    result = {"prompt": args.prompt, "runs": args.runs, "threads": args.threads, "configs": {}}
    for name, (env, extra) in parsed.items():
        result["configs"][name] = {
            "env": env, "args": extra, "first_run_s": first[name],
            "wall_s": walls[name], "median_s": statistics.median(walls[name]),
        }  # fmt: skip
        print(f"{name}: median {statistics.median(walls[name]):.2f} s "
              f"(first run {first[name]:.2f} s)")  # fmt: skip
    save(result, args.out, plot)


def plot(result: dict, plt):
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(result["configs"])
    ax.barh(names, [result["configs"][n]["median_s"] for n in names])
    ax.set_xlabel("seconds, process start to exit (median)")
    ax.set_title(f"specinfer generate {result['prompt']!r}, {result['runs']} runs")
    return fig


if __name__ == "__main__":
    main()
