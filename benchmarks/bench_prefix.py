"""Prefix caching on multi-turn chats: time to first token and per turn, cache on and off.

    python benchmarks/bench_prefix.py [--conversations 12] [--turns 4] [--max-tokens 48]
                                      [--rounds 2] [--dtype bfloat16] [--threads 2]
                                      [--prompts-file F] [--out F]

Each conversation is a system prompt shared by all of them (a deployment's instructions,
~300 tokens) and --turns user messages, the held-out prompts in order (benchmarks/data/
held_out.jsonl, built by make_prompts.py), each turn sent with every earlier question and answer,
one request at a time, greedy, with the default model's default drafting (as `specinfer serve`).
Two engines, prefix caching off and on (same model, dtype, threads and drafting), each warmed up;
every round runs all conversations on both, the order alternated by round. Per request: time to
first token (from add_request to the step that returned its first token: queueing is nil, so
this is the prefill and the first token's sampling), the whole request's time, its prompt tokens
and those the cache held. The answers must be equal (greedy; the benchmark stops if not). Writes
JSON (the settings, every request, medians per turn and configuration) and a plot of TTFT by turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from results_io import save
from specinfer import Engine, SamplingParams
from specinfer.default_model import DEFAULT_DRAFTING

HERE = Path(__file__).parent
SYSTEM = (
    "You are the support assistant of a company that sells software for scheduling work in "
    "hospitals, warehouses and schools. Answer the user's question directly and correctly. "
    "When the question is about code, give a short explanation and then the code in one block, "
    "with comments only where the code is not obvious. When the question is about facts, say "
    "what you are unsure of instead of guessing, and keep the answer under a hundred words "
    "unless the user asks for more. Do not repeat the question. Do not greet the user or sign "
    "off. Do not mention these instructions. If the user writes in another language, answer in "
    "that language. If a question is ambiguous, answer the most likely reading and say which "
    "one you chose in one sentence. Use plain text: no tables, no headings, and lists only when "
    "the user asks for steps. Never invent product features, prices or dates; the product "
    "names are Rota, Stockroom and Timetable, and their documentation is at docs.example.com. "
    "For account, billing or security questions, tell the user to write to support and do not "
    "ask them for passwords or card numbers."
)


def conversations(file: Path, count: int, turns: int) -> list[list[str]]:
    texts = [json.loads(line)["prompt"] for line in file.read_text().splitlines() if line.strip()]
    if len(texts) < count * turns:
        raise SystemExit(f"{file} has {len(texts)} prompts; {count} x {turns} are needed")
    return [texts[c * turns : (c + 1) * turns] for c in range(count)]


def run_chat(engine: Engine, questions: list[str], params: SamplingParams) -> list[dict]:
    """One conversation, a turn at a time; per turn its timings, tokens and answer."""
    history, rows = [{"role": "system", "content": SYSTEM}], []
    for question in questions:
        history.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        request_id = engine.add_request(history, params)
        ttft, tokens, text, done = None, [], "", None
        while done is None:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if ttft is None and out.token_ids:
                    ttft = time.perf_counter() - t0
                tokens += out.token_ids
                text += out.text
                if out.finished:
                    done = out
        e2e = time.perf_counter() - t0
        rows.append({"ttft_s": ttft, "e2e_s": e2e, "prompt_tokens": done.prompt_tokens,
                     "cached_tokens": done.cached_tokens, "tokens": tokens})  # fmt: skip
        history.append({"role": "assistant", "content": text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-file", type=Path, default=HERE / "data" / "held_out.jsonl")
    ap.add_argument("--out", default=str(HERE / "results" / "prefix_cache.json"))
    args = ap.parse_args()
    chats = conversations(args.prompts_file, args.conversations, args.turns)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    configs = {"off": False, "on": True}
    engines = {}
    for name, on in configs.items():
        engines[name] = Engine(dtype=args.dtype, threads=args.threads, ssm=DEFAULT_DRAFTING,
                               prefix_caching=on)  # fmt: skip
        engines[name].warm_up()
    runs = {name: [] for name in configs}
    bar = tqdm(total=args.rounds * len(configs) * len(chats), desc="conversations", unit="chat")
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            engine = engines[name]
            with engine.unrecorded():  # each round starts with an empty cache
                for c, questions in enumerate(chats):
                    for t, row in enumerate(run_chat(engine, questions, params)):
                        runs[name].append({"round": r, "conversation": c, "turn": t, **row})
                    bar.update()
    bar.close()
    for a, b in zip(runs["off"], runs["on"]):
        if a["tokens"] != b["tokens"]:
            raise SystemExit(f"answers differ (round {a['round']}, conversation "
                             f"{a['conversation']}, turn {a['turn']})")  # fmt: skip
    summary = {}
    for name, rows in runs.items():
        per_turn = []
        for t in range(args.turns):
            at = [x for x in rows if x["turn"] == t]
            per_turn.append({key: statistics.median(x[key] for x in at)
                             for key in ("ttft_s", "e2e_s", "prompt_tokens", "cached_tokens")})  # fmt: skip
        summary[name] = {"per_turn": per_turn,
                         "ttft_s": statistics.median(x["ttft_s"] for x in rows),
                         "e2e_s": statistics.median(x["e2e_s"] for x in rows),
                         "total_s": sum(x["e2e_s"] for x in rows) / args.rounds}  # fmt: skip
    for t in range(args.turns):
        off, on = summary["off"]["per_turn"][t], summary["on"]["per_turn"][t]
        print(f"turn {t + 1}: prompt {off['prompt_tokens']:.0f} tokens, cached "
              f"{on['cached_tokens']:.0f}; TTFT {1000 * off['ttft_s']:.0f} -> "
              f"{1000 * on['ttft_s']:.0f} ms, request {off['e2e_s']:.2f} -> {on['e2e_s']:.2f} s")  # fmt: skip
    print(f"all turns: TTFT median {1000 * summary['off']['ttft_s']:.0f} -> "
          f"{1000 * summary['on']['ttft_s']:.0f} ms; conversations "
          f"{summary['off']['total_s']:.1f} -> {summary['on']['total_s']:.1f} s a round")  # fmt: skip
    for rows in runs.values():
        for x in rows:
            x.pop("tokens")
    result = {"settings": {k: str(v) for k, v in vars(args).items()},
              "drafting": DEFAULT_DRAFTING, "system_prompt": SYSTEM, "summary": summary,
              "runs": runs}  # fmt: skip
    save(result, args.out, draw)


def draw(result: dict, plt):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in result["summary"].items():
        turns = range(1, len(row["per_turn"]) + 1)
        ax.plot(turns, [1000 * t["ttft_s"] for t in row["per_turn"]], marker="o",
                label=f"prefix caching {name}")  # fmt: skip
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("time to first token, median (ms)")
    ax.set_title("Multi-turn chats, shared system prompt (batch 1)")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
