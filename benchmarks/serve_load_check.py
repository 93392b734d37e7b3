"""Load check of `specinfer serve`: many streamed greedy requests at several Poisson arrival
rates, some clients disconnecting mid-stream; every completed response must equal the same
request run offline (Engine.generate, same model, dtype and drafting), and afterwards no request
may run or wait, the KV cache must be empty, and the server's memory must be back near its level
after warm-up.

    python benchmarks/serve_load_check.py --requests 300 --rates 2 4 8 --disconnect-every 10
                                          [--kv-budget TOKENS]

--kv-budget gives the server a KV budget below what its requests can hold together, so requests
wait and are preempted; the offline outputs they must equal are computed without one.

Writes benchmarks/results/serve_load.json; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from bench_serve import DEFAULT_PROMPTS, ROOT, P, load_prompts, scrape, server, wait_idle
from results_io import save


def as_messages(prompt) -> list[dict]:
    """The chat request the server gets for a prompt (text becomes one user message)."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def offline_expected(prompts: list, lengths: list[int], args) -> dict:
    """(prompt index, max_tokens) -> (text, finish_reason, tokens) from Engine.generate."""
    from specinfer import Engine, SamplingParams

    engine = Engine(args.model, dtype=args.dtype, threads=args.threads,
                    ssm=["default", "ngram"], max_batch_size=args.max_batch_size)  # fmt: skip
    keys = sorted({(i % len(prompts), n) for i, n in enumerate(lengths)})
    outs = engine.generate([as_messages(prompts[i]) for i, _ in keys],
                           [SamplingParams(max_tokens=n) for _, n in keys])  # fmt: skip
    return {k: (o.text, o.finish_reason, len(o.token_ids)) for k, o in zip(keys, outs)}


async def one(client, url, messages, max_tokens, disconnect: bool) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    text, reason, usage, done, chunks = "", None, None, False, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                reason = choice.get("finish_reason") or reason
                chunks += 1
            if disconnect and chunks >= 2:
                return {"disconnected": True}  # leaving the block closes the connection
    return {"text": text, "finish_reason": reason, "usage": usage, "done": done}


async def rate_run(url, prompts, lengths, indices, rate, args) -> list[dict]:
    rng = random.Random(int(rate * 1000))
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        tasks = []
        for i in indices:
            disconnect = args.disconnect_every and i % args.disconnect_every == 3
            messages = as_messages(prompts[i % len(prompts)])
            tasks.append(asyncio.create_task(one(client, url, messages, lengths[i], disconnect)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks, return_exceptions=True)


def plot(result: dict, plt):
    runs = result["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(runs))
    bottom = [0] * len(runs)
    for key in ("ok", "disconnected", "mismatch", "error"):
        values = [r[key] for r in runs]
        a.bar(x, values, bottom=bottom, label=key)
        bottom = [u + v for u, v in zip(bottom, values)]
    a.set_xticks(list(x), [f"{r['rate']:g}/s" for r in runs])
    a.set_ylabel("requests")
    a.set_title("responses by outcome (ok = equal to offline)")
    a.legend()
    b.plot([f"{r['rate']:g}/s" for r in runs], [r["rss_mb"] for r in runs], "o-", label="after run")
    b.axhline(result["rss_mb_after_warmup"], color="gray", ls="--", label="after warm-up")
    b.set_ylabel("server RSS (MB)")
    b.legend()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--disconnect-every", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--kv-budget", type=int, default=None, help="the server's KV budget (tokens)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_load.json"))
    args = ap.parse_args()
    args.server_args = f"--kv-budget {args.kv_budget}" if args.kv_budget else ""
    args.startup_timeout, args.stop_timeout = 300.0, 30.0
    prompts, source = load_prompts(args.prompts_file)
    rng = random.Random(0)
    lengths = [rng.choice(args.max_tokens) for _ in range(args.requests)]
    t0 = time.perf_counter()
    expected = offline_expected(prompts, lengths, args)
    print(f"offline: {len(expected)} distinct requests in {time.perf_counter() - t0:.0f} s")
    result = {"requests": args.requests, "rates": args.rates, "prompts": source,
              "disconnect_every": args.disconnect_every, "runs": []}  # fmt: skip
    failures = []
    with server([], args) as (url, info):
        # Warm-up at full load: the batch shapes' graphs are recorded once, then kept.
        asyncio.run(rate_run(url, prompts, lengths, range(2 * args.max_batch_size), 50.0, args))
        wait_idle(url)
        rss_warm = rss_mb(info["pid"])
        per_rate = -(-args.requests // len(args.rates))
        for k, rate in enumerate(args.rates):
            indices = range(k * per_rate, min(args.requests, (k + 1) * per_rate))
            t = time.perf_counter()
            outs = asyncio.run(rate_run(url, prompts, lengths, indices, rate, args))
            seconds = time.perf_counter() - t
            counts = {"ok": 0, "disconnected": 0, "mismatch": 0, "error": 0}
            for i, out in zip(indices, outs):
                want_text, want_reason, want_tokens = expected[(i % len(prompts), lengths[i])]
                if isinstance(out, BaseException) or "error" in out:
                    counts["error"] += 1
                    failures.append(f"request {i}: {out!r}")
                elif out.get("disconnected"):
                    counts["disconnected"] += 1
                elif (out["text"], out["finish_reason"], out["usage"], out["done"]) == (
                        want_text, want_reason, want_tokens, True):  # fmt: skip
                    counts["ok"] += 1
                else:
                    counts["mismatch"] += 1
                    failures.append(
                        f"request {i}: got {out!r}, want {(want_text, want_reason, want_tokens)}"
                    )
            m = wait_idle(url)
            idle = {"running": m.get(P + "num_requests_running"), "waiting": m.get(P + "num_requests_waiting"),
                    "kv_usage": m.get(P + "kv_cache_usage_perc")}  # fmt: skip
            if any(v != 0 for v in idle.values()):
                failures.append(f"rate {rate}: not idle afterwards: {idle}")
            run = {"rate": rate, "seconds": round(seconds, 1), **counts, "after": idle,
                   "rss_mb": round(rss_mb(info["pid"]), 1)}  # fmt: skip
            result["runs"].append(run)
            print(f"rate {rate:g}/s: {len(indices)} requests in {seconds:.0f} s: {counts}, "
                  f"after: {idle}, server RSS {run['rss_mb']:.0f} MB (warm {rss_warm:.0f})")  # fmt: skip
        result["rss_mb_after_warmup"] = round(rss_warm, 1)
        counters = scrape(url)
        result["aborts_counted"] = counters.get(
            P + 'requests_finished_total{finished_reason="abort"}'
        )
        result["kv_budget"] = args.kv_budget
        result["preemptions"] = counters.get(P + "num_preemptions_total")
    result["server"] = info
    growth = result["runs"][-1]["rss_mb"] - rss_warm
    result["rss_growth_mb"] = round(growth, 1)
    if growth > 0.1 * rss_warm:
        failures.append(f"server memory grew {growth:.0f} MB over {rss_warm:.0f} MB after warm-up")
    result["failures"] = failures
    save(result, args.out, plot)
    print(f"aborted (server's count): {result['aborts_counted']}; preempted: "
          f"{result['preemptions']}; RSS growth {growth:+.0f} MB")  # fmt: skip
    print("FAILED:\n  " + "\n  ".join(failures[:20]) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
