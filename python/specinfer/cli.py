"""Command line: `specinfer generate "prompt"` streams a completion."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: if it has one)",
    )
    args = parser.parse_args(argv)

    from specinfer import Engine, SamplingParams  # after parsing: --help stays instant

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        engine = Engine(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
        use_chat = args.chat if args.chat is not None else bool(engine.tokenizer.chat_template)
        prompt = [{"role": "user", "content": args.prompt}] if use_chat else args.prompt
        for delta in engine.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"specinfer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
