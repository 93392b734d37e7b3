"""Tree attention (specinfer.ops) against torch's scaled_dot_product_attention with an explicit
boolean mask, on the same CUDA tensors and shapes: Llama-7B and SmolLM2 heads, prefixes 128..4096,
trees of 8..64 nodes, batch 1 and 16, bfloat16. Times each op with CUDA events (the mean of a few
back-to-back calls, best of several groups) and writes the results as JSON with a plot beside it.

    python benchmarks/bench_sdpa_gpu.py --out sdpa.json
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from results_io import save
from specinfer import ops

HEADS = {"llama7b": (32, 32, 128), "smollm2": (9, 3, 64)}
PREFIXES = (128, 512, 2048, 4096)
TREES = (8, 20, 64)
BATCHES = (1, 16)


def binary_tree_mask(tokens: int) -> torch.Tensor:
    """Ancestor-or-self mask of a binary tree (node i's parent is (i - 1) // 2), as the C++
    benchmarks use."""
    mask = torch.zeros(tokens, tokens, dtype=torch.bool)
    for i in range(tokens):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = (j - 1) // 2
    return mask


def time_us(fn, groups: int = 5, calls: int = 10) -> float:
    """Best over `groups` of the mean time of `calls` back-to-back calls, in microseconds."""
    for _ in range(3):
        fn()
    best = math.inf
    for _ in range(groups):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) * 1e3 / calls)
    return best


def run_case(model: str, prefix: int, tree: int, batch: int, gqa_arg: bool) -> dict:
    hq, hkv, d = HEADS[model]
    seq = prefix + tree
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dt)

    q, k_cache, v_cache = (
        randn(batch, tree, hq, d),
        randn(batch, hkv, seq, d),
        randn(batch, hkv, seq, d),
    )
    rows = torch.arange(batch, device="cuda")
    prefix_lens = torch.full((batch,), prefix, device="cuda")
    tree_mask = binary_tree_mask(tree).cuda().expand(batch, tree, tree).contiguous()

    # SDPA's layout, prepared outside the timing: q [B, Hq, T, D], mask [B, 1, T, L].
    q_sdpa = q.transpose(1, 2).contiguous()
    full_mask = torch.ones(batch, 1, tree, seq, dtype=torch.bool, device="cuda")
    full_mask[:, 0, :, prefix:] = tree_mask
    k_sdpa, v_sdpa, kwargs = k_cache, v_cache, {}
    if hq != hkv:
        if gqa_arg:
            kwargs["enable_gqa"] = True
        else:  # older torch: expand the KV heads up front (not timed)
            k_sdpa = k_cache.repeat_interleave(hq // hkv, dim=1)
            v_sdpa = v_cache.repeat_interleave(hq // hkv, dim=1)

    def ours():
        return ops.tree_attention(  # as the models call it: no host check of the indices
            q, k_cache, v_cache, rows, prefix_lens, tree_mask, check_indices=False
        )

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, attn_mask=full_mask, **kwargs)

    diff = (ours().float() - sdpa().transpose(1, 2).float()).abs().max().item()
    ours_us, sdpa_us = time_us(ours), time_us(sdpa)
    elem = torch.finfo(dt).bits // 8
    bytes_moved = elem * (2 * batch * hkv * seq * d + 2 * batch * tree * hq * d)
    return dict(
        model=model,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        prefix=prefix,
        tree=tree,
        batch=batch,
        ours_us=ours_us,
        sdpa_us=sdpa_us,
        speedup=sdpa_us / ours_us,
        bytes=bytes_moved,
        ours_bytes_per_s=bytes_moved / (ours_us * 1e-6),
        max_abs_diff=diff,
    )


def supports_enable_gqa() -> bool:
    """Whether this torch's SDPA takes enable_gqa (2.5+); a builtin has no signature to read."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def draw(result: dict, plt):
    """Per model, each shape's time: tree attention beside SDPA (log scale)."""
    models = list(dict.fromkeys(r["model"] for r in result["results"]))
    fig, axes = plt.subplots(len(models), 1, figsize=(14, 4.5 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        rows = [r for r in result["results"] if r["model"] == model]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ours_us"] for r in rows], 0.4, label="tree_attention")
        ax.bar([i + 0.2 for i in x], [r["sdpa_us"] for r in rows], 0.4, label="SDPA, explicit mask")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"p{r['prefix']}\nt{r['tree']}\nb{r['batch']}" for r in rows])
        ax.set_xlabel("p: prefix tokens, t: tree nodes, b: batch")
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(f"{model} heads, bfloat16, {result['meta']['device']}")
        ax.legend()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"bench_sdpa_gpu: torch {torch.__version__} sees no CUDA device")
    gqa_arg = supports_enable_gqa()
    results = []
    print(f"{'shape':<44} {'ours us':>9} {'sdpa us':>9} {'speedup':>8} {'GB/s':>7} {'maxdiff':>8}")
    for model in HEADS:
        for prefix in PREFIXES:
            for tree in TREES:
                for batch in BATCHES:
                    r = run_case(model, prefix, tree, batch, gqa_arg)
                    results.append(r)
                    shape = f"{model} prefix={prefix} tree={tree} batch={batch}"
                    print(
                        f"{shape:<44} {r['ours_us']:9.1f} {r['sdpa_us']:9.1f} "
                        f"{r['speedup']:8.2f} {r['ours_bytes_per_s'] / 1e9:7.0f} "
                        f"{r['max_abs_diff']:8.4f}",
                        flush=True,
                    )
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        sdpa_enable_gqa=gqa_arg,
        dtype="bfloat16",
    )
    save(dict(meta=meta, results=results), args.out, draw)
    slower = [r for r in results if r["speedup"] < 1.0]
    print(f"tree_attention faster than SDPA on {len(results) - len(slower)}/{len(results)} shapes")


if __name__ == "__main__":
    main()
