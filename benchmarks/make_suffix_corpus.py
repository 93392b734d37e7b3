"""A corpus for the suffix drafter: the target's own greedy answers to a prompt file, each line
the JSON list of a request's token ids (prompt + answer). Start a drafter from it with
ssm=[..., "suffix:corpus=PATH"].

    python benchmarks/make_suffix_corpus.py --prompts benchmarks/data/train.jsonl \
        --out benchmarks/.cache/suffix_corpus.jsonl [--model PATH] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from bench_spec import load_prompts
from specinfer import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help='a .jsonl of {"prompt": ...} lines')
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="(default: the default model)")
    parser.add_argument("--tokens", type=int, default=128, help="answer length")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [x for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    prompts = load_prompts(len(lines), args.prompts, args.chat)
    engine = Engine(args.model, dtype="bfloat16", threads=args.threads, max_batch_size=args.batch)
    params = SamplingParams(max_tokens=args.tokens)  # greedy, stopping at EOS as served
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for start in tqdm(range(0, len(prompts), args.batch), desc="answers", unit="batch"):
            chunk = prompts[start : start + args.batch]
            for prompt, answer in zip(chunk, engine.generate(chunk, params)):
                f.write(json.dumps(engine.prompt_ids(prompt) + answer.token_ids) + "\n")
    print(f"wrote {out} ({len(prompts)} sequences)")


if __name__ == "__main__":
    main()
