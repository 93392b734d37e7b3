"""Decode latency, side by side in one run: specinfer vs HF transformers (vs llama.cpp when
installed) vs the memory-bandwidth lower bound. Same model, dtype and thread count for all.

    python benchmarks/bench_decode.py [--model PATH] [--threads 2] [--batch 1 8] [--tokens 128]

Per-step decode time is (time to generate N tokens - time to generate 1) / (N - 1), the same
measurement for every system, so prefill is excluded. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from results_io import save
from specinfer import Engine, SamplingParams

PROMPTS = [
    "The history of the printing press begins",
    "def merge_sort(items):",
    "Write a short story about a lighthouse keeper.",
    "The mitochondria is",
    "In 1969, the Apollo 11 mission",
    "Translate to French: The weather is nice today.",
    "A list of prime numbers: 2, 3, 5, 7,",
    "SELECT name, age FROM users WHERE",
]


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def per_step_ms(generate, tokens: int, repeats: int) -> float:
    full = best_of(lambda: generate(tokens), repeats)
    first = best_of(lambda: generate(1), repeats)
    return 1000 * (full - first) / (tokens - 1)


def bench_ours(engine: Engine, prompts: list[str], tokens: int, repeats: int) -> float:
    def generate(n):
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

    return per_step_ms(generate, tokens, repeats)


def bench_hf(model_path: Path, dtype: torch.dtype, prompts: list[str], tokens: int, repeats: int):
    import transformers

    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    src = str(model_path.parent if model_path.suffix == ".gguf" else model_path)
    tok = transformers.AutoTokenizer.from_pretrained(src, **kwargs)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs).eval()
    batch = tok(prompts, return_tensors="pt", padding=True)

    @torch.inference_mode()
    def generate(n):
        model.generate(
            **batch,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )

    return per_step_ms(generate, tokens, repeats)


def bench_llama_cpp(model_path: Path, threads: int, tokens: int, repeats: int) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(str(model_path), n_threads=threads, n_ctx=512, verbose=False)

    def generate(n):
        llm.reset()
        llm.create_completion(PROMPTS[0], max_tokens=n, temperature=0.0, ignore_eos=True)

    return per_step_ms(generate, tokens, repeats)


def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth: best time of summing a 512 MB buffer (far beyond the caches)."""
    torch.set_num_threads(threads)
    buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    seconds = best_of(lambda: buf.sum(), 5)
    return buf.numel() * 4 / seconds / 1e9


def weight_bytes_per_token(engine: Engine) -> int:
    """Bytes of weights one decode step reads: every parameter once, except that the embedding
    table is only gathered (one row) unless it is also the LM head."""
    model = engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not engine.config.tie_word_embeddings:
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embed is not None:
            total -= embed.weight.numel() * embed.weight.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        engine = Engine(args.model, dtype=dtype, threads=args.threads)
        bound = 1000 * weight_bytes_per_token(engine) / (bandwidth * 1e9)
        for batch in args.batch:
            prompts = (PROMPTS * batch)[:batch]
            row = {"dtype": dtype_name, "batch": batch, "bound_ms": bound}
            row["specinfer_ms"] = bench_ours(engine, prompts, args.tokens, args.repeats)
            if not args.no_hf:
                row["hf_ms"] = bench_hf(
                    engine.model_path, dtype, prompts, args.tokens, args.repeats
                )
            rows.append(row)
            print(json.dumps(row))
        model_path = engine.model_path
        del engine

    llama_cpp_ms = None
    if model_path.suffix == ".gguf":
        llama_cpp_ms = bench_llama_cpp(model_path, args.threads, args.tokens, args.repeats)

    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "model": str(args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF, dequantised)"),
        "tokens": args.tokens,
        "read_bandwidth_gbs": bandwidth,
        "llama_cpp_ms": llama_cpp_ms,
        "llama_cpp_note": "same GGUF file, native quantised kernels, batch 1"
        if llama_cpp_ms
        else "not installed",
        "rows": rows,
    }
    save(result, args.out, plot)


def plot(result: dict, plt):
    rows = result["rows"]
    labels = [f"{r['dtype']}\nbatch {r['batch']}" for r in rows]
    series = [
        ("specinfer_ms", "specinfer"),
        ("hf_ms", "HF transformers"),
        ("bound_ms", "bandwidth bound"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        values = [r.get(key, 0.0) for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    if result["llama_cpp_ms"]:
        ax.axhline(result["llama_cpp_ms"], color="k", linestyle="--", label="llama.cpp (batch 1)")
    ax.set_xticks([x + width for x in range(len(rows))], labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode latency, {result['machine']['threads']} threads")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
