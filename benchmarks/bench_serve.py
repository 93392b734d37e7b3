"""Online serving benchmark: the real `specinfer serve` under load, one server per configuration.

    python benchmarks/bench_serve.py [--configs NAME[=ARGS] ...] [--concurrency 1 4 16]
                                     [--rates 1 2 4] [--requests 32] [--max-tokens 64]
                                     [--temperature 0] [--max-batch-size 16] [--server-args ARGS]
                                     [--endpoint chat|completions] [--prompts-file F] [--quick]
                                     [--repeats N] [--prefix-caching]

- Each configuration starts `python -m specinfer.cli serve` as a subprocess on 127.0.0.1 (a free
  port; same model, --dtype, --threads, --max-batch-size; --server-args and the configuration's
  own arguments appended), waits for GET /health 200, sends --warmup unmeasured requests, runs
  every load run against that one process, and stops it (SIGTERM, then SIGKILL after
  --stop-timeout) however the benchmark ends: finished, an error, Ctrl-C or SIGTERM.
  A configuration is NAME=ARGS (ARGS split like a shell: `whole="--whole-trees"`) or a preset
  name: incremental (--mode incremental), speculative or spec (the default: the shipped SSM +
  n-gram with the cost-aware cut), whole (--whole-trees).
- Load: asyncio + httpx, streaming (SSE, stream_options.include_usage), --requests per run.
  Fixed concurrency C: C clients, each sending its next request when its last one ends. Poisson
  rate R: requests sent at exponential inter-arrival times (mean 1/R s, seeded RNG: the same
  schedule for every configuration), whatever is in flight. Request i takes prompt i (prompts
  shuffled once with --seed), so every run and configuration gets the same prompts. Greedy
  (temperature 0) unless --temperature (then request i has seed --seed + i). Every run ends by
  itself: a bounded count, --request-timeout per request, --run-deadline for the run (requests
  still open then are cancelled and counted failed).
- Per run, measured by the client from the moment a request is sent: TTFT (to the first chunk
  carrying text), TPOT = (e2e - TTFT) / (output tokens - 1), ITL (gaps between chunks carrying
  text; speculation sends several tokens in one chunk, so ITL >= TPOT), e2e latency; p50, p99 and
  mean over the requests that succeeded. Output tokens are the final usage's completion_tokens.
  Throughput = successful requests (output tokens) / (last request's end - run start). failed:
  HTTP error, error event, timeout or deadline; truncated: a stream that ended without [DONE], a
  finish_reason stop/length or usage. From GET /metrics scraped before and after the run (once
  the server is idle), the differences of specinfer:spec_decode_num_drafts_total,
  _num_draft_tokens_total, _num_accepted_tokens_total (+ generation/prompt tokens, preemptions,
  finished requests): accepted tokens per draft (verification step of a request; vLLM's mean
  acceptance length is 1 + that) and acceptance rate = accepted / draft tokens (tree siblings
  count as drafts, so it is lower than a chain's).
- Prompts: --prompts-file (default benchmarks/data/held_out.jsonl, {"prompt"} or {"messages"}
  a line; if the default file is missing, benchmarks/data/make_prompts.py is run to build it,
  and if that fails a few built-in prompts are used; the JSON says which), sent as one user
  message to /v1/chat/completions (--endpoint completions: the raw prompt text).
- --repeats N: N rounds over the configurations, each in a rotated order (round r starts with
  configuration r mod count) and with a fresh server, so slow drift of the machine (this VM's
  speed varies by 10-30% over minutes) spreads over every configuration instead of landing on
  one. Each run records its round; the summary (printed, and `summary` in the JSON) gives per
  configuration and load point the median output tokens/s over the rounds with its range, and
  which configuration is best by median; the plot draws the medians, the rounds as dots.
- --server-per-run: a fresh server (and warm-up) for every load run. Needed where a server learns
  from what it served (`--ssm suffix`: its history): every run sends the same prompts, so on one
  server later runs would be drafted from earlier runs' answers to them (measured: n-gram +
  suffix at concurrency 4 accepted 5.05 tokens a draft after a concurrency-1 run, 0.92 fresh).
  The benchmark warns when a configuration names a suffix drafter without it.
- Servers run with --no-prefix-caching unless --prefix-caching: every run sends the same prompts
  (and the warm-up some of them), so a server caching prompts would find later runs' cached and
  the load points would not compare. benchmarks/bench_prefix.py measures prefix caching.
- --quick: a check that runs in about a minute or two (6 requests, concurrency 1 and 2,
  max_tokens 16, no rates) into benchmarks/results/serve_quick.json.
Writes JSON (--out) with the settings and every run, and a PNG beside it; prints a line a run.
The load generator runs on the same machine as the server and takes some of its CPU; each run
records the machine's load average, to tell when other work competed for it too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from results_io import save

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "benchmarks" / "data" / "held_out.jsonl"
PRESETS = {"incremental": "--mode incremental", "speculative": "", "spec": "",
           "whole": "--whole-trees"}  # fmt: skip
BUILTIN_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is and when to use one.",
    "Write a short poem about the sea at night.",
    "Summarize the rules of chess in a few sentences.",
    "Complete the following Python function.\n\n```python\ndef is_palindrome(s):\n"
    "    '''Return True if s reads the same forwards and backwards.'''\n```",
    "Describe how a binary search works, step by step.",
]
P = "specinfer:"
# Counters differenced over a run: /metrics sample name -> key in the run's "server" entry.
COUNTERS = {
    P + "spec_decode_num_drafts_total": "num_drafts",
    P + "spec_decode_num_draft_tokens_total": "num_draft_tokens",
    P + "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    P + "generation_tokens_total": "generation_tokens",
    P + "prompt_tokens_total": "prompt_tokens",
    P + "num_preemptions_total": "preemptions",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=["incremental", "speculative"],
                        help="NAME=ARGS or a preset: " + ", ".join(PRESETS))  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="*", default=None,
                        help="fixed-concurrency runs (default 1 4 16)")  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="*", default=[],
                        help="Poisson runs, requests per second")  # fmt: skip
    parser.add_argument("--requests", type=int, default=None, help="requests per run (32)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (64)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="every request runs max_tokens")
    parser.add_argument("--seed", type=int, default=0, help="prompt order, arrivals, sampling")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--server-args", default="", help="more `specinfer serve` arguments")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests per server")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds (300)")
    parser.add_argument("--run-deadline", type=float, default=None, help="seconds a run (900)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=20.0,
                        help="seconds after SIGTERM before SIGKILL")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the configurations, rotated (see above)")  # fmt: skip
    parser.add_argument("--server-per-run", action="store_true",
                        help="a fresh server for every load run (see above)")  # fmt: skip
    parser.add_argument("--prefix-caching", action="store_true",
                        help="let the servers cache prompts (see above)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="6 requests, concurrency 1 2, max_tokens 16: proves it works")  # fmt: skip
    parser.add_argument("--out", default=None,
                        help="JSON (default benchmarks/results/serve.json, serve_quick.json "
                        "with --quick)")  # fmt: skip
    args = parser.parse_args()
    quick = args.quick
    defaults = dict(concurrency=[1, 2] if quick else [1, 4, 16], requests=6 if quick else 32,
                    max_tokens=16 if quick else 64, request_timeout=60.0 if quick else 300.0,
                    run_deadline=120.0 if quick else 900.0,
                    out=f"benchmarks/results/serve{'_quick' if quick else ''}.json")  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.warmup = min(args.warmup, 1)
    configs = parse_configs(args.configs)
    runs = len(args.concurrency) + len(args.rates)
    learning = [name for name, extra in configs.items()
                if any("suffix" in a for a in extra + shlex.split(args.server_args))]  # fmt: skip
    if learning and runs > 1 and not args.server_per_run:
        print(f"warning: {', '.join(learning)} draft from what the server served before, and "
              "every run sends the same prompts: later runs would be drafted from earlier "
              "runs' answers. Pass --server-per-run.", file=sys.stderr)  # fmt: skip
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    prompts, source = load_prompts(args.prompts_file)
    random.Random(args.seed).shuffle(prompts)

    # SIGTERM to the benchmark ends it like Ctrl-C, so the server is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    result = {
        "settings": {
            "argv": sys.argv[1:],
            "model": args.model,
            "dtype": args.dtype,
            "threads": args.threads,
            "max_batch_size": args.max_batch_size,
            "server_args": args.server_args,
            "prefix_caching": args.prefix_caching,
            "configs": configs,
            "endpoint": args.endpoint,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "concurrency": args.concurrency,
            "rates": args.rates,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "request_timeout_s": args.request_timeout,
            "run_deadline_s": args.run_deadline,
            "prompts_file": args.prompts_file,
            "prompts_source": source,
            "prompts": len(prompts),
            "quick": quick,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },  # fmt: skip
        "configs": {},
    }
    print(f"prompts: {len(prompts)} ({source}); configs: {configs}")
    t_all = time.perf_counter()
    try:
        order = list(configs.items())
        for round_ in range(args.repeats):
            k = round_ % len(order)
            for name, extra in order[k:] + order[:k]:
                entry = bench_config(name, extra, prompts, args, round_)
                merged = result["configs"].setdefault(name, {**entry, "runs": []})
                merged["runs"] += entry["runs"]
                if "error" in entry:
                    merged["error"] = entry["error"]
    except KeyboardInterrupt:
        print("interrupted: the server was stopped; nothing written", file=sys.stderr)
        raise SystemExit(130) from None
    result["settings"]["wall_s"] = round(time.perf_counter() - t_all, 1)
    result["summary"] = summary(result)
    for line in summary_lines(result["summary"]):
        print(line)
    save(result, args.out, plot)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_configs(items: list[str]) -> dict[str, list[str]]:
    """['incremental', 'whole=--whole-trees --tree 1,1'] -> {name: serve arguments}."""
    configs = {}
    for item in items:
        name, eq, extra = item.partition("=")
        if not eq:
            if name not in PRESETS:
                raise SystemExit(f"unknown configuration {name!r}: NAME=ARGS or one of {PRESETS}")
            extra = PRESETS[name]
        configs[name] = shlex.split(extra)
    return configs


def load_prompts(path: str) -> tuple[list, str]:
    """The prompts (strings or message lists) and where they came from."""
    file, source = Path(path), "file"
    if not file.exists() and file.resolve() == DEFAULT_PROMPTS:
        print(f"{file} is missing: running benchmarks/data/make_prompts.py")
        try:
            subprocess.run([sys.executable, str(ROOT / "benchmarks/data/make_prompts.py")],
                           cwd=ROOT, check=True, timeout=600)  # fmt: skip
            source = "generated by make_prompts.py"
        except (subprocess.SubprocessError, OSError) as e:
            print(f"make_prompts.py failed ({e}): built-in prompts")
    if not file.exists():
        if file.resolve() != DEFAULT_PROMPTS:
            raise SystemExit(f"no prompts file {file}")
        return list(BUILTIN_PROMPTS), "built-in (make_prompts.py failed)"
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    prompts = [r["messages"] if "messages" in r else r["prompt"] for r in rows]
    if not prompts:
        raise SystemExit(f"no prompts in {file}")
    return prompts, f"{source}: {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# --- the server ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(extra: list[str], args):
    """A running `specinfer serve` (its base URL); stopped on the way out, whatever happened.
    Yields (url, info); info gets the command, startup time, and at the end the exit status."""
    port = free_port()
    cmd = [sys.executable, "-m", "specinfer.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-batch-size", str(args.max_batch_size),
           "--dtype", args.dtype, "--threads", str(args.threads), "--log-level", "warning",
           "--shutdown-timeout", "5", *(["--model", args.model] if args.model else []),
           *([] if args.prefix_caching else ["--no-prefix-caching"]),
           *shlex.split(args.server_args), *extra]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="bench_serve_", suffix=".log", delete=False)
    info = {"command": shlex.join(cmd[1:])}
    # Its own session: the terminal's Ctrl-C reaches only us, and we stop it below.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    info["pid"] = proc.pid
    try:
        t0 = time.perf_counter()
        deadline = t0 + args.startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{tail(log.name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"no /health 200 after {args.startup_timeout:g} s:\n"
                                   f"{tail(log.name)}")  # fmt: skip
            time.sleep(0.5)
        info["startup_s"] = round(time.perf_counter() - t0, 1)
        yield url, info
    finally:
        info["exit_status"] = stop(proc, args.stop_timeout)
        log.close()
        if info["exit_status"] != 0:
            info["log_tail"] = tail(log.name)
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def stop(proc: subprocess.Popen, timeout: float) -> int | str:
    """SIGTERM (graceful drain), then SIGKILL after `timeout` s; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"killed after {timeout:g} s"
    return proc.returncode


def tail(path: str, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    return ""


def scrape(url: str) -> dict[str, float]:
    """GET /metrics: sample name (with its labels) -> value."""
    samples = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[key] = float(value)
    return samples


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Scrape /metrics once no request runs or waits (aborted ones may take a step to end)."""
    deadline = time.perf_counter() + timeout
    while True:
        m = scrape(url)
        idle = (
            m.get(P + "num_requests_running", 0) == 0 and m.get(P + "num_requests_waiting", 0) == 0
        )
        if idle or time.perf_counter() > deadline:
            return m
        time.sleep(0.2)


def server_delta(before: dict, after: dict) -> dict:
    d = {key: after.get(name, 0.0) - before.get(name, 0.0) for name, key in COUNTERS.items()}
    drafts, nodes, accepted = d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]
    d["accepted_per_draft"] = accepted / drafts if drafts else None
    d["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    d["acceptance_rate"] = accepted / nodes if nodes else None
    d["draft_tokens_per_draft"] = nodes / drafts if drafts else None
    d["finished"] = {
        name.split('"')[1]: after[name] - before.get(name, 0.0)
        for name in after
        if name.startswith(P + "requests_finished_total{") and after[name] - before.get(name, 0.0)
    }
    for hist, key in (("time_to_first_token_seconds", "mean_ttft_s"),
                      ("e2e_request_latency_seconds", "mean_e2e_s")):  # fmt: skip
        n = after.get(f"{P}{hist}_count", 0) - before.get(f"{P}{hist}_count", 0)
        s = after.get(f"{P}{hist}_sum", 0) - before.get(f"{P}{hist}_sum", 0)
        d[key] = s / n if n else None
    return d


# --- the load --------------------------------------------------------------------------------


def bench_config(name: str, extra: list[str], prompts: list, args, round_: int = 0) -> dict:
    entry = {"serve_args": extra, "runs": []}
    plan = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]
    for runs in [[run] for run in plan] if args.server_per_run else [plan]:
        if not _serve_runs(name, extra, prompts, args, round_, runs, entry):
            break
    return entry


def _serve_runs(name: str, extra: list[str], prompts: list, args, round_: int, plan: list,
                entry: dict) -> bool:  # fmt: skip
    """The load runs of `plan` against one server, into `entry` (the server's command, startup
    and exit status appended to its "servers": one per run with --server-per-run); False after
    an error."""
    info = {}
    try:
        with server(extra, args) as (url, info):
            entry.setdefault("servers", []).append(info)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            print(f"[{name}] server up in {info['startup_s']} s ({info['command']})")
            if args.warmup:
                asyncio.run(warmup(url, model, prompts, args))
            for kind, value in plan:
                before = wait_idle(url)
                run = asyncio.run(load_run(url, model, prompts, args, kind, value))
                run["server"] = server_delta(before, wait_idle(url))
                run["round"] = round_
                entry["runs"].append(run)
                print(run_line(name, run), flush=True)
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as e:
        entry["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] error: {entry['error']}", file=sys.stderr)
    if info.get("exit_status") not in (0, None):
        print(f"[{name}] server exit status {info['exit_status']}", file=sys.stderr)
    return "error" not in entry


def request_body(model: str, prompt, index: int, max_tokens: int, args) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if args.temperature > 0:
        body["seed"] = args.seed + index
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    if isinstance(prompt, list):
        raise SystemExit("--endpoint completions needs text prompts, not messages")
    return "/v1/completions", {**body, "prompt": prompt}


def new_record(index: int) -> dict:
    return {"index": index, "sent": None, "ttft": None, "e2e": None, "tokens": 0, "chunks": 0,
            "finish_reason": None, "done": False, "usage": False,
            "error": "not sent before the run deadline", "gaps": []}  # fmt: skip


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens: int,
                      args, rec: dict) -> dict:  # fmt: skip
    """Send one streamed request, filling `rec` (new_record()) with its timings (s, from
    sending) and outcome as they come, so a cancelled request's record is there too."""
    path, body = request_body(model, prompt, rec["index"], max_tokens, args)
    rec["sent"], rec["error"] = time.perf_counter(), None
    t0, last = rec["sent"], None

    async def stream() -> None:
        nonlocal last
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec["error"] = f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done"] = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = f"error event: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    rec["usage"] = True
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    text = (
                        choice.get("text") if "text" in choice else choice["delta"].get("content")
                    )
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["gaps"].append(now - last)
                        last = now
                        rec["chunks"] += 1
                    if choice.get("finish_reason"):
                        rec["finish_reason"] = choice["finish_reason"]
        rec["e2e"] = time.perf_counter() - t0

    try:
        await asyncio.wait_for(stream(), args.request_timeout)
    except asyncio.TimeoutError:
        rec["error"] = f"timeout after {args.request_timeout:g} s"
    except asyncio.CancelledError:
        rec["error"] = "cancelled at the run deadline"
        rec["ended"] = time.perf_counter()
        raise
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["ended"] = time.perf_counter()
    return rec


async def warmup(url: str, model: str, prompts: list, args) -> None:
    """Unmeasured requests, all at once: the first shapes' graphs and the tree budget's timings."""
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        recs = await asyncio.gather(*(one_request(client, url, model, prompts[-1 - i], 8, args,
                                                  new_record(-1 - i)) for i in range(args.warmup)))  # fmt: skip
    bad = [r["error"] for r in recs if r["error"]]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0]}")


async def load_run(url: str, model: str, prompts: list, args, kind: str, value: float) -> dict:
    n = args.requests
    records = [new_record(i) for i in range(n)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def send(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            await one_request(client, url, model, prompt, args.max_tokens, args, records[i])

        start, load_before = time.perf_counter(), os.getloadavg()[0]
        if kind == "concurrency":
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:  # shared: each worker takes the next request
                    await send(i)

            tasks = [asyncio.create_task(worker()) for _ in range(min(int(value), n))]
        else:
            rng = random.Random(f"{args.seed}-{value}")
            offsets, t = [], 0.0
            for _ in range(n):
                offsets.append(t)
                t += rng.expovariate(value)

            async def at(i: int) -> None:
                await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
                await send(i)

            tasks = [asyncio.create_task(at(i)) for i in range(n)]
        _, pending = await asyncio.wait(tasks, timeout=args.run_deadline)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    run = summarize(kind, value, records, start)
    # The machine's 1-minute load average (server, load generator and anything else running):
    # above the core count, other work took CPU from the server.
    run["loadavg_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    return run


def pct(values: list[float], scale: float = 1000.0) -> dict:
    """p50/p99/mean (in ms by default) of values, or Nones if there are none."""
    if not values:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    a = np.asarray(values) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "n": len(values)}  # fmt: skip


def summarize(kind: str, value: float, records: list[dict], start: float) -> dict:
    def status(r: dict) -> str:
        if r["error"]:
            return "failed"
        whole = r["done"] and r["usage"] and r["finish_reason"] in ("stop", "length")
        return "ok" if whole else "truncated"

    failed = [r for r in records if status(r) == "failed"]
    truncated = [r for r in records if status(r) == "truncated"]
    ok = [r for r in records if status(r) == "ok"]
    end = max((r["ended"] for r in records if r.get("ended")), default=start)
    duration = end - start
    tokens = sum(r["tokens"] for r in ok)
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    sent = [r["sent"] - start for r in records if r.get("sent") is not None]
    return {
        "mode": kind,
        "concurrency" if kind == "concurrency" else "rate": value,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "truncated": len(truncated),
        "errors": sorted({r["error"] for r in failed})[:5],
        "finish_reasons": reasons,
        "duration_s": duration,
        "offered_rate": (len(sent) - 1) / max(sent) if kind == "rate" and len(sent) > 1 else None,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_tokens": tokens,
        "output_throughput": tokens / duration if duration > 0 else None,
        "output_tokens_per_request": tokens / len(ok) if ok else None,
        "tokens_per_chunk": tokens / sum(r["chunks"] for r in ok) if ok else None,
        "ttft_ms": pct([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_ms": pct(
            [
                (r["e2e"] - r["ttft"]) / (r["tokens"] - 1)
                for r in ok
                if r["ttft"] is not None and r["tokens"] > 1
            ]
        ),  # fmt: skip
        "itl_ms": pct([g for r in ok for g in r["gaps"]]),
        "e2e_ms": pct([r["e2e"] for r in ok]),
        "per_request": [
            {
                "index": r["index"],
                "sent_s": round(r["sent"] - start, 4) if r.get("sent") else None,
                "ttft_ms": _ms(r.get("ttft")),
                "e2e_ms": _ms(r.get("e2e")),
                "tokens": r.get("tokens"),
                "chunks": r.get("chunks"),
                "finish_reason": r.get("finish_reason"),
                "error": r["error"],
            }
            for r in records
        ],  # fmt: skip
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 2)


def _f(x, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def run_line(name: str, run: dict) -> str:
    where = (f"conc {run['concurrency']:<3g}" if run["mode"] == "concurrency"
             else f"rate {run['rate']:<4g}")  # fmt: skip
    s = run["server"]
    return (f"[{name}] {where} ok {run['completed']}/{run['requests']} "
            f"(failed {run['failed']}, truncated {run['truncated']}) "
            f"{_f(run['output_throughput'], '.1f')} tok/s {_f(run['request_throughput'], '.2f')} req/s | "
            f"TTFT p50 {_f(run['ttft_ms']['p50'])} p99 {_f(run['ttft_ms']['p99'])} ms | "
            f"TPOT p50 {_f(run['tpot_ms']['p50'], '.1f')} p99 {_f(run['tpot_ms']['p99'], '.1f')} ms | "
            f"ITL p50 {_f(run['itl_ms']['p50'], '.1f')} ms | e2e p50 {_f(run['e2e_ms']['p50'])} "
            f"p99 {_f(run['e2e_ms']['p99'])} ms | acc/draft {_f(s['accepted_per_draft'], '.2f')} "
            f"acc rate {_f(s['acceptance_rate'], '.2f')}")  # fmt: skip


def _point(run: dict) -> tuple[str, float]:
    return run["mode"], run[run["mode"]]


def summary(result: dict) -> list[dict]:
    """Per load point: each configuration's median output tokens/s over the rounds, its range,
    and the best configuration by median."""
    points = sorted({_point(r) for c in result["configs"].values() for r in c["runs"]})
    out = []
    for point in points:
        row = {"mode": point[0], point[0]: point[1], "tokens_per_s": {}}
        for name, config in result["configs"].items():
            ys = [r["output_throughput"] for r in config["runs"]
                  if _point(r) == point and r["output_throughput"] is not None]  # fmt: skip
            if ys:
                row["tokens_per_s"][name] = {"median": statistics.median(ys), "min": min(ys),
                                             "max": max(ys), "rounds": ys}  # fmt: skip
        if row["tokens_per_s"]:
            row["best"] = max(row["tokens_per_s"], key=lambda n: row["tokens_per_s"][n]["median"])
        out.append(row)
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        cells = [f"{name} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]"
                 for name, v in row["tokens_per_s"].items()]  # fmt: skip
        lines.append(f"{row['mode']} {row[row['mode']]:g}: median tok/s [range] "
                     f"{' | '.join(cells)} -> best {row.get('best')}")  # fmt: skip
    return lines


# --- the plot --------------------------------------------------------------------------------


def plot(result: dict, plt):
    modes = [m for m in ("concurrency", "rate")
             if any(r["mode"] == m for c in result["configs"].values() for r in c["runs"])]  # fmt: skip
    modes = modes or ["concurrency"]
    panels = (("output_throughput", None, "output tokens/s"),
              ("tpot_ms", "p50", "p50 TPOT (ms)"), ("ttft_ms", "p50", "p50 TTFT (ms)"))  # fmt: skip
    fig, axes = plt.subplots(len(modes), 3, figsize=(15, 4 * len(modes)), squeeze=False)
    s = result["settings"]
    for row, mode in zip(axes, modes):
        for ax, (key, sub, label) in zip(row, panels):
            for name, config in result["configs"].items():
                runs = [r for r in config["runs"] if r["mode"] == mode]
                ys = [r[key] if sub is None else r[key][sub] for r in runs]
                pts = [(r[mode], y) for r, y in zip(runs, ys) if y is not None]
                if not pts:
                    continue
                xs = sorted({x for x, _ in pts})
                medians = [statistics.median(y for x2, y in pts if x2 == x) for x in xs]
                (line,) = ax.plot(xs, medians, marker="o", label=name)
                if len(pts) > len(xs):  # several rounds: each one as a dot
                    ax.scatter(*zip(*pts), s=10, alpha=0.4, color=line.get_color())
            xlabel = "concurrent clients" if mode == "concurrency" else "Poisson rate (requests/s)"
            ax.set(title=f"{label} vs {mode}", xlabel=xlabel, ylabel=label, ylim=(0, None))
            if mode == "concurrency":
                xs = sorted({r["concurrency"] for c in result["configs"].values()
                             for r in c["runs"] if r["mode"] == mode})  # fmt: skip
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [f"{x:g}" for x in xs])
                ax.minorticks_off()
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.suptitle(f"specinfer serve: {s['requests']} requests x max_tokens {s['max_tokens']}, "
                 f"{s['dtype']}, {s['threads']} threads, T={s['temperature']:g}, "
                 f"max batch {s['max_batch_size']}")  # fmt: skip
    return fig


if __name__ == "__main__":
    main()
