"""The speculator: a small speculative model (SSM) that drafts a token tree per request.

The SSM keeps its own KV cache, with the same row per request as the target's and the same slot
layout: the root (the request's newest token) sits at slot `prefix = len(tokens) - 1` and tree node
i at `prefix + i`. So after verification one depth-first commit of the accepted path serves both
caches. The SSM runs one batched forward per tree depth over that depth's nodes, each seeing the
committed prefix plus its own ancestors (the generalised tree mask covers the earlier levels).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from specinfer import ops
from specinfer.sampling import SamplingParams, probabilities
from specinfer.tree import TokenTree, TreeConfig


def layer_selected(target: nn.Module, num_layers: int) -> nn.Module:
    """An SSM made of the target's first `num_layers` layers + final norm + LM head. It shares
    the target's weights (no copy) and gets its own, smaller KV cache."""
    total = target.config.num_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"layer-selected SSM needs 1 <= layers < {total} (the target's depth), got {num_layers}"
        )
    if not hasattr(target, "model") or not hasattr(target.model, "layers"):
        raise ValueError(
            f"layer selection is supported for Llama-family models, not {type(target).__name__}"
        )
    ssm = copy.copy(target)
    ssm._modules = dict(target._modules)
    ssm.model = copy.copy(target.model)
    ssm.model._modules = dict(target.model._modules)
    ssm.model.layers = nn.ModuleList(list(target.model.layers)[:num_layers])
    ssm.config = dataclasses.replace(target.config, num_layers=num_layers)
    return ssm


class Speculator:
    def __init__(self, model: nn.Module, tree: TreeConfig, name: str = "ssm"):
        self.model = model
        self.tree = tree
        self.name = name
        self.kv = None

    def reset(self, rows: int, max_seq_len: int) -> None:
        self.kv = self.model.make_kv_cache(rows, max_seq_len)

    def draft(self, batch: list, tokens: list[list[int]], max_depths: list[int]) -> list[TokenTree]:
        """Draft one tree per request. `batch[b]` has .row, .ssm_len (tokens in the SSM cache),
        .params and .generator; tokens[b] is its whole sequence; max_depths[b] caps its depth."""
        dev = self.kv.k[0].device
        rows = torch.tensor([r.row for r in batch], device=dev)
        # Level 0: feed what the SSM has not seen yet (the root, and tokens accepted last step).
        pending = [seq[r.ssm_len :] for r, seq in zip(batch, tokens)]
        hidden = self._forward(rows, pending, [r.ssm_len for r in batch])
        last = torch.tensor([len(p) - 1 for p in pending], device=dev)
        logits = self.model.compute_logits(hidden[torch.arange(len(batch), device=dev), last])
        for r, seq in zip(batch, tokens):
            r.ssm_len = len(seq)
        trees = [TokenTree(seq[-1]) for seq in tokens]
        frontier = [[0] for _ in batch]
        node_logits = [[logits[b]] for b in range(len(batch))]
        for depth, width in enumerate(self.tree.widths, start=1):
            live = [b for b in range(len(batch)) if depth <= max_depths[b]]
            if not live:
                break
            for b in live:
                for node, lg in zip(frontier[b], node_logits[b]):
                    self._expand(trees[b], node, lg, width, batch[b].params, batch[b].generator)
                frontier[b] = trees[b].nodes_at(depth)
            live = [b for b in live if depth < max_depths[b]]  # leaves need no SSM step
            if not live:
                break
            hidden = self._forward_level(rows[live], [trees[b] for b in live], [frontier[b] for b in live],
                                         [len(tokens[b]) - 1 for b in live])  # fmt: skip
            for i, b in enumerate(live):
                node_logits[b] = list(self.model.compute_logits(hidden[i, : len(frontier[b])]))
        return trees

    def commit(self, batch: list, prefix: list[int], paths: list[list[int]], trees: list[TokenTree],
               max_depths: list[int]) -> None:  # fmt: skip
        """Keep the accepted nodes the SSM has K/V for (all but leaves at its last depth)."""
        kept = [[n for n in path if trees[b].depths[n] < min(self.tree.depth, max_depths[b])]
                for b, path in enumerate(paths)]  # fmt: skip
        dev = self.kv.k[0].device
        ops.kv_commit(self.kv.k + self.kv.v, torch.tensor([r.row for r in batch], device=dev),
                      torch.tensor(prefix, device=dev), _pad(kept, -1, dev))  # fmt: skip
        for r, p, k in zip(batch, prefix, kept):
            r.ssm_len = p + len(k)

    # -- internals ------------------------------------------------------------------------------

    def _expand(self, tree: TokenTree, node: int, logits: torch.Tensor, width: int,
                params: SamplingParams, generator: torch.Generator) -> None:  # fmt: skip
        if params.greedy or not self.tree.sample_children:
            # Deterministic top-k: each child is a point-mass proposal.
            k = min(width, logits.shape[-1])
            tokens, _ = ops.topk_expand(logits[None], k, params.temperature)
            for t in tokens[0].tolist():
                tree.propose(node, t)
            return
        q = probabilities(logits, params.temperature, params.top_k, params.top_p)
        row = tree.add_distribution(q)
        for t in torch.multinomial(q, width, replacement=True, generator=generator).tolist():
            tree.propose(node, t, row)

    def _forward(self, rows, chains: list[list[int]], prefix: list[int]) -> torch.Tensor:
        """Run right-padded token chains (causal) after each request's prefix."""
        dev = rows.device
        T = max(len(c) for c in chains)
        ids = _pad(chains, 0, dev)
        valid = ids.new_tensor([[t < len(c) for t in range(T)] for c in chains], dtype=torch.bool)
        mask = (
            torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            & valid[:, None, :]
            & valid[:, :, None]
        )
        prefix_t = torch.tensor(prefix, device=dev)
        positions = prefix_t[:, None] + torch.arange(T, device=dev)
        return self.model(ids, positions, self.kv, rows, prefix_t, mask)

    def _forward_level(
        self, rows, trees: list[TokenTree], levels: list[list[int]], roots: list[int]
    ) -> torch.Tensor:
        """Run one depth's nodes; node i of a tree lives at slot root_slot + i."""
        dev = rows.device
        T = max(len(lv) for lv in levels)
        firsts = [lv[0] for lv in levels]  # a level's nodes are numbered consecutively
        M = max(firsts) - 1 + T  # mask columns: earlier non-root nodes + this level
        mask = torch.zeros(len(trees), T, M, dtype=torch.bool)
        for b, (tree, lv, first) in enumerate(zip(trees, levels, firsts)):
            # column j is slot prefix + T - M + j, i.e. node first + T - M + j; <= 0 is committed
            cols = [first + T - M + j for j in range(M)]
            mask[b, :, [j for j, c in enumerate(cols) if c <= 0]] = True
            real = [j for j, c in enumerate(cols) if 0 < c < len(tree)]
            mask[b, : len(lv), real] = tree.ancestor_mask(lv, [cols[j] for j in real])
        ids = _pad([[tree.tokens[n] for n in lv] for tree, lv in zip(trees, levels)], 0, dev)
        depth = trees[0].depths[levels[0][0]]
        prefix = torch.tensor([root + first for root, first in zip(roots, firsts)], device=dev)
        positions = torch.tensor(roots, device=dev)[:, None].expand(-1, T) + depth
        return self.model(ids, positions, self.kv, rows, prefix, mask.to(dev))


def load_speculator(
    spec, target: nn.Module, target_path: Path, tree: TreeConfig, dtype, device
) -> Speculator:
    """`spec`: an int L / "layers:L" (the target's first L layers), or a model path."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.startswith("layers:")):
        n = spec if isinstance(spec, int) else _parse_layers(spec)
        return Speculator(layer_selected(target, n), tree, name=f"layers:{n}")
    from specinfer.loader import load_model

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"SSM not found: {path} (a model path, or layers:L for a layer-selected SSM)"
        )
    model = load_model(path, dtype=dtype, device=device)
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"SSM {path.name} has vocabulary size {model.config.vocab_size}, the target "
            f"{target_path.name} has {target.config.vocab_size}: they must share a tokenizer"
        )
    return Speculator(model, tree, name=path.name)


def _parse_layers(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"expected layers:L with an integer L, got {spec!r}") from None


def _pad(seqs: list[list[int]], value: int, device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], device=device)
