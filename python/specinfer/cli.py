"""Command line: `specinfer generate "prompt"` streams a completion; `specinfer chat` holds a
conversation on the terminal; `specinfer serve` serves an OpenAI-compatible HTTP API; `specinfer
train-ssm` distils an SSM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specinfer.training import command as training_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    gen.add_argument("prompt", help="the prompt text")
    _add_generation_args(gen)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: if it has one)",
    )
    chat = sub.add_parser(
        "chat", help="talk with the model: each line you type is a turn, its answer streamed"
    )
    _add_generation_args(chat)
    chat.add_argument("--system", default=None, help="a system prompt for the conversation")
    _add_serve_parser(sub)
    train = sub.add_parser(
        "train-ssm", help="distil a small speculative model (SSM) from the target's layers"
    )
    training_command.add_arguments(train)
    args = parser.parse_args(argv)
    if args.command == "train-ssm":
        return training_command.run(args)
    if args.command == "serve":
        return _serve(args)
    return _generate(args)


def _add_generation_args(gen) -> None:
    """The options generate and chat share: model, sampling, speculation, structured output."""
    gen.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    # SmolLM2's model card samples with temperature 0.2, top_p 0.9; a mild frequency penalty
    # keeps a small model from looping. (HF's repetition penalty scales logits, so it moves the
    # SSM's differently offset logits unlike the target's: fewer drafts accepted. The OpenAI
    # penalties subtract, which any offset survives.)
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.2,
        help="sampling temperature (default 0.2); 0 = greedy decoding, with no penalty unless "
        "one is given: the model's exact argmax output",
    )
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=0.9, help="default 0.9; 1 = off")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="leave out tokens less likely than this times the most likely one "
                     "(default 0 = off)")  # fmt: skip
    gen.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="OpenAI's, in [-2, 2] (default 0.3 when sampling, 0 with --temperature 0 or "
        "--mode dsi)",
    )
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's (default 1 = off)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument(
        "--ssm",
        action="append",
        default=None,
        help="speculative model: a model path, layers:L (the target's first L layers), default "
        "(the SSM shipped for the default model), feature (its feature head; feature:PATH for "
        "one trained with train-ssm --kind feature), or ngram[:max_n=3,min_n=3,depth=8,branches=1] "
        "(prompt lookup), or suffix[:max_n=6,depth=8,nodes=16,corpus=PATH|default] (continuations "
        "from earlier requests); repeat it to merge their trees. Default: default, ngram and "
        "suffix:corpus=default for the default model, ngram for others (turn off with --mode "
        "incremental)",
    )
    gen.add_argument(
        "--ssm-head",
        type=int,
        default=None,
        help="SSM LM head over N tokens (its head_tokens.json, else the first N ids; 0 = full; "
        "default: up to 8192 of head_tokens.json if present, else full)",
    )
    gen.add_argument(
        "--no-ssm-int8",
        dest="ssm_int8",
        action="store_false",
        default=None,
        help="model SSMs draft with their weights as loaded, not 8-bit copies (default on the "
        "CPU: half the bytes a drafting call streams; lossless either way)",
    )
    gen.add_argument(
        "--tree",
        default=None,
        help="expansion config of the model SSMs, e.g. 1,1,3,1 (default: a tree drafted as deep "
        "as the measured costs pay for, up to 4,4,2,2,2,2,2,2 with a beam of 4; with "
        "--whole-trees: 1 for the shipped SSM, else the paper's 1,1,3,1,1,1,1,1)",
    )
    gen.add_argument(
        "--mode",
        choices=["incremental", "sequence", "tree", "dsi"],
        default=None,
        help="default: tree when an SSM is used, else incremental; dsi: speculation "
        "parallelism (the drafter runs ahead while --target-servers verify its blocks)",
    )
    gen.add_argument(
        "--target-servers",
        type=int,
        default=1,
        help="with --mode dsi: target server processes, each a copy of the model (default 1)",
    )
    gen.add_argument(
        "--lookahead",
        type=int,
        default=None,
        help="with --mode dsi: drafted tokens per verification task (default: the one with "
        "the lowest expected latency, at most Equation 1's, from the drafter's latency, a "
        "server's forward cost by rows and the acceptance rate, measured at start; where no "
        "lookahead is expected to pay, the servers decode without drafts)",
    )
    gen.add_argument(
        "--whole-trees",
        action="store_true",
        help="verify every drafted node (default: only the part of each tree worth its cost in "
        "the target forward, learned while decoding; lossless either way)",
    )
    gen.add_argument(
        "--max-tree-nodes",
        type=int,
        default=None,
        help="verify at most N nodes of a request's tree a step, root included (default: no cap)",
    )
    gen.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="shard each layer over N processes (spawned here, or torchrun's; default 1)",
    )
    gen.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        help="split the layers into M stages, one process (or TP group) each (default 1)",
    )
    add_offload_args(gen)
    gen.add_argument(
        "--json-schema",
        default=None,
        help="structured output: the answer is JSON matching this schema (JSON text, a file "
        'holding it, or "object" for any JSON object)',
    )
    gen.add_argument("--regex", default=None, help="structured output: the answer matches it")
    gen.add_argument(
        "--choice",
        action="append",
        default=None,
        help="structured output: the answer is one of these strings (repeat it)",
    )
    gen.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")


def _generate(args) -> int:
    """generate and chat."""
    from specinfer import SamplingParams  # after parsing: --help stays instant

    try:
        frequency = args.frequency_penalty
        if frequency is None:  # DSI refuses penalties: its default is none
            frequency = 0.3 if args.temperature > 0 and args.mode != "dsi" else 0.0
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=frequency,
            json_schema=_json_schema(args.json_schema),
            regex=args.regex,
            choice=args.choice,
        )
        with engine_from_args(args) as engine:  # stops any worker or server processes
            if args.command == "chat":
                from specinfer.repl import converse

                converse(engine, params, args.system, _format_stats if args.stats else None)
                return 0
            use_chat = args.chat if args.chat is not None else bool(engine.tokenizer.chat_template)
            prompt = [{"role": "user", "content": args.prompt}] if use_chat else args.prompt
            for delta in engine.stream(prompt, params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            if args.stats:
                print(_format_stats(engine.last_metrics), file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"specinfer: error: {e}", file=sys.stderr)
        return 2
    return 0


def _json_schema(value: str | None) -> dict | str | None:
    """--json-schema: "object", a file holding the schema, or the schema's JSON text."""
    if value == "object":
        return {"type": "object"}
    if value is not None and not value.lstrip().startswith("{") and Path(value).is_file():
        return Path(value).read_text()
    return value


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (needs the serve extra)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics. SIGTERM/SIGINT "
        "shut it down gracefully.",
    )
    serve.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="requests (but to /health and /metrics) must send 'Authorization: Bearer KEY' "
        "(default: $SPECINFER_API_KEY; none: the server is open)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' (default: the model file or directory name, "
        "SmolLM2-135M-Instruct for the default model)",
    )
    serve.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    serve.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="web pages whose scripts may call the server (CORS), e.g. http://localhost:3000, "
        "or '*' for any (default: none)",
    )
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--threads", type=int, default=None)
    serve.add_argument(
        "--ssm",
        action="append",
        default=None,
        help="speculative model(s), as for generate (default: default, ngram and "
        "suffix:corpus=default for the default model, ngram for others; turn off with --mode "
        "incremental)",
    )
    serve.add_argument("--ssm-head", type=int, default=None, help="as for generate")
    serve.add_argument("--no-ssm-int8", dest="ssm_int8", action="store_false", default=None,
                       help="as for generate")  # fmt: skip
    serve.add_argument("--tree", default=None, help="expansion config, as for generate")
    serve.add_argument("--mode", choices=["incremental", "sequence", "tree"], default=None)
    serve.add_argument(
        "--whole-trees", action="store_true", help="verify every drafted node (as for generate)"
    )
    serve.add_argument(
        "--max-tree-nodes", type=int, default=None, help="as for generate (default: no cap)"
    )
    serve.add_argument(
        "--tensor-parallel", type=int, default=1, help="as for generate (default: 1)"
    )
    serve.add_argument(
        "--pipeline-parallel", type=int, default=1, help="as for generate (default: 1)"
    )
    add_offload_args(serve)
    serve.add_argument("--max-batch-size", type=int, default=16, help="requests run at once")
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens a request may hold, prompt + output (default: the model's context)",
    )
    serve.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="KV cache size in tokens; below max batch size x max model length, requests "
        "wait or are preempted when it is full (default: that product)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="prefill every prompt whole: by default a request beginning with the tokens of an "
        "earlier one (a shared system prompt, a chat's earlier turns) reuses their cached K/V",
    )
    serve.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="answer /health as soon as the model is loaded, without first serving two short "
        "requests of its own (they record the op graphs the first clients would wait for; "
        "skipped with --offload)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM/SIGINT before they are aborted",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def add_offload_args(parser) -> None:
    parser.add_argument(
        "--offload",
        choices=["disk", "cpu"],
        default=None,
        help="stream the target's layers each forward: from a file (disk; written once) or, on "
        "CUDA, from pinned host memory (cpu); default: weights resident",
    )
    parser.add_argument(
        "--offload-dir",
        default=None,
        help="folder of the offloaded layer files (default: ~/.cache/specinfer/offload)",
    )
    parser.add_argument(
        "--resident-layers",
        type=int,
        default=0,
        help="with --offload: keep the first N layers resident (default 0)",
    )


def _serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:  # the serve extra is missing
        print(f"specinfer: error: {e} (pip install 'specinfer[serve]')", file=sys.stderr)
        return 2
    from specinfer.server import serve

    return serve.run(args)


def engine_from_args(args, **serving):
    """The Engine the model and speculation options describe (generate's and serve's), with
    `serving` knobs (max_batch_size, ...) on top."""
    from specinfer import Engine

    ssm = args.ssm
    if ssm is None and args.mode != "incremental":
        ssm = "auto"  # the shipped drafters for the default model, prompt lookup for others
    template = read_chat_template(args.chat_template) if args.chat_template else None
    engine = Engine(args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                    ssm=ssm, tree=args.tree, mode=args.mode, ssm_head=args.ssm_head,
                    ssm_int8=args.ssm_int8, adaptive_tree=not args.whole_trees,
                    max_tree_nodes=args.max_tree_nodes,
                    tensor_parallel=args.tensor_parallel,
                    pipeline_parallel=args.pipeline_parallel, offload=args.offload,
                    offload_dir=args.offload_dir, resident_layers=args.resident_layers,
                    target_servers=getattr(args, "target_servers", 1),
                    lookahead=getattr(args, "lookahead", None), **serving)  # fmt: skip
    if template is not None:
        engine.tokenizer.use_template(template)
    return engine


CHAT_TEMPLATE_HELP = (
    "render chats with this Jinja template (a file, or the template itself) instead of the "
    "model's: for a model that has none, or one that renders tools wrongly"
)


def read_chat_template(value: str) -> str:
    """--chat-template's template: a file's text, or the value itself if it is a template."""
    from specinfer.tokenizer import check_template

    if "{{" in value or "{%" in value:  # a template (too long a text for a path, often)
        source = value
    elif Path(value).expanduser().is_file():
        source = Path(value).expanduser().read_text()
    else:
        raise ValueError(f"--chat-template: no such file, and not a template: {value}")
    check_template(source)  # before the model loads
    return source


def _format_stats(m: dict) -> str:
    tokens, decode_s = m["generated_tokens"], m["decode_s"]
    per_token = 1000 * decode_s / max(1, tokens - 1)
    return (
        f"[{tokens} tokens, {m['steps']} decode steps, {m['tokens_per_step']:.2f} tokens/step, "
        f"{per_token:.1f} ms/token (prefill {1000 * m['prefill_s']:.0f} ms"
        + (f", {m['cached_tokens']} prompt tokens cached" if m.get("cached_tokens") else "")
        + "; "
        f"ssm {1000 * m['ssm_s']:.0f} ms, target {1000 * m['target_s']:.0f} ms, "
        f"verify {1000 * m['verify_s']:.0f} ms, commit {1000 * m['commit_s']:.0f} ms)"
        + "".join(
            f"; {s['name']}: {s['accepted']} accepted, {1000 * s['ssm_s']:.0f} ms"
            for s in m.get("per_ssm", [])
        )  # fmt: skip
        + (
            f"; weights streamed: {m['weight_bytes'] / max(1, tokens) / 1e6:.1f} MB/token, "
            f"{1000 * m['stream_wait_s']:.0f} ms waited for them"
            if m.get("weight_bytes")
            else ""
        )  # fmt: skip
        + (
            "; dsi: {blocks_verified} blocks verified, {wasted_forwards} wasted forwards, "
            "{preemptions} preemptions, drafter idle {drafter_idle_s:.2f} s, target idle "
            "{target_idle_s:.2f} s".format(**m["dsi"])
            if m.get("dsi")
            else ""
        )  # fmt: skip
        + "]"
    )


if __name__ == "__main__":
    sys.exit(main())
