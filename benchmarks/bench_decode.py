"""Decode latency, side by side in one run: specinfer vs HF transformers (vs llama.cpp when
installed) vs the memory-bandwidth lower bound. Same model, dtype and thread count for all.

    python benchmarks/bench_decode.py [--model PATH] [--threads 2] [--batch 1 8] [--tokens 128]
        [--device cuda]

Per-step decode time is (time to generate N tokens - time to generate 1) / (N - 1), the same
measurement for every system, so prefill is excluded. Both systems get the same token ids (our
tokenizer's). Writes JSON and a PNG plot. On a GPU machine without the default model, time a
model of its shape with random weights (benchmarks/random_model.py).
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


def bench_ours(engine: Engine, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    def generate(n):
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

    return per_step_ms(generate, tokens, repeats)


def bench_hf(model_path: Path, dtype: torch.dtype, device: str, prompts: list[list[int]],
             tokens: int, repeats: int) -> float:  # fmt: skip
    import transformers

    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    src = str(model_path.parent if model_path.suffix == ".gguf" else model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs)
    model = model.to(device).eval()
    width = max(len(p) for p in prompts)  # left-padded with token 0, masked out
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    @torch.inference_mode()
    def generate(n):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)  # fmt: skip
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return per_step_ms(generate, tokens, repeats)


def gguf_as(src: Path, dtype: str, out_dir: Path) -> Path:
    """A copy of the GGUF file `src` with every matrix stored as `dtype` (float32 or bfloat16),
    dequantised from the original, so llama.cpp decodes the same weights in the same dtype as we
    do. Vectors (norms) stay float32, as llama.cpp's converter writes them. Cached in out_dir."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    target = {"float32": Q.F32, "bfloat16": Q.BF16}[dtype]
    out = out_dir / f"{src.stem}.{dtype}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out.with_suffix(".part"), arch)
    file_type = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.BF16: gguf.LlamaFileType.MOSTLY_BF16}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # written by GGUFWriter itself
        value = int(file_type[target]) if field.name == "general.file_type" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        kind = target if data.ndim > 1 else Q.F32
        data = gguf.quants.quantize(data, kind) if kind == Q.BF16 else data
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".part").rename(out)
    return out


def bench_llama_cpp(model_path: Path, threads: int, tokens: int, repeats: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(str(model_path), n_threads=threads, n_ctx=512, verbose=False)

    no_eos = {llm.token_eos(): -1e9}  # always n tokens, as ignore_eos does for the others

    def generate(n):
        llm.reset()
        llm.create_completion(PROMPTS[0], max_tokens=n, temperature=0.0, logit_bias=no_eos)

    return per_step_ms(generate, tokens, repeats)


def llama_cpp_rows(model_path: Path, args) -> dict:
    """llama.cpp at batch 1 on the same weights: the GGUF file as it is (its native, quantised
    kernels) and converted to each of our dtypes."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"note": "llama-cpp-python not installed (pip install llama-cpp-python)"}
    if model_path.suffix != ".gguf":
        return {"note": "llama.cpp needs a GGUF model"}
    result = {"native_ms": bench_llama_cpp(model_path, args.threads, args.tokens, args.repeats)}
    for dtype in args.dtypes:
        path = gguf_as(model_path, dtype, Path(args.gguf_cache))
        result[f"{dtype}_ms"] = bench_llama_cpp(path, args.threads, args.tokens, args.repeats)
    print("llama.cpp:", json.dumps(result))
    return result


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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    parser.add_argument(
        "--gguf-cache", default="benchmarks/.cache", help="where float32/bfloat16 GGUF copies go"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    on_cpu = args.device == "cpu"
    bandwidth = read_bandwidth_gbs(args.threads) if on_cpu else None  # the bound is the CPU's
    if on_cpu:
        print(f"memory read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        engine = Engine(args.model, dtype=dtype, threads=args.threads, device=args.device)
        bound = 1000 * weight_bytes_per_token(engine) / (bandwidth * 1e9) if on_cpu else None
        for batch in args.batch:
            prompts = [engine.tokenizer.encode(p) for p in (PROMPTS * batch)[:batch]]
            row = {"dtype": dtype_name, "batch": batch, "bound_ms": bound}
            row["specinfer_ms"] = bench_ours(engine, prompts, args.tokens, args.repeats)
            if not args.no_hf:
                row["hf_ms"] = bench_hf(
                    engine.model_path, dtype, args.device, prompts, args.tokens, args.repeats
                )
            rows.append(row)
            print(json.dumps(row))
        model_path = engine.model_path
        del engine

    llama_cpp = llama_cpp_rows(model_path, args) if on_cpu else {"note": "CPU only"}

    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "device": torch.cuda.get_device_name() if not on_cpu else "cpu",
        },  # fmt: skip
        "model": str(args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF, dequantised)"),
        "tokens": args.tokens,
        "read_bandwidth_gbs": bandwidth,
        "llama_cpp_batch1": llama_cpp,
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
        values = [r.get(key) or 0.0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    llama = result.get("llama_cpp_batch1", {})
    for dtype, style in (("bfloat16", "--"), ("float32", ":")):
        if f"{dtype}_ms" in llama:
            ax.axhline(llama[f"{dtype}_ms"], color="k", linestyle=style,
                       label=f"llama.cpp {dtype}, batch 1")  # fmt: skip
    ax.set_xticks([x + width for x in range(len(rows))], labels)
    ax.set_ylabel("ms per decode step")
    machine = result["machine"]
    where = machine.get("device", "cpu")
    where = f"{machine['threads']} threads" if where == "cpu" else where
    ax.set_title(f"Decode latency, {where}")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
