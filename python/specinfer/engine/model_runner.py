"""The target model's forwards for one step: prompt chunks, decode tokens, token trees.

It owns the model and the op graphs recorded over the KV cache (graphs.py); each forward takes
the cache, the sequences' rows, and their tokens, and returns logits. A sequence's new tokens go
to the slots right after its cached ones; every row of a batch is padded to the same width and
its padding masked out (the kernels compute a row the same way whatever rows share the call).
"""

from __future__ import annotations

import torch
from torch import nn

from specinfer.engine.sequence import Sequence
from specinfer.graphs import GraphRunner
from specinfer.tree import TokenTree


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.graphs = GraphRunner(model)
        self.max_positions = model.config.max_position_embeddings

    def prefill(self, kv, chunks: list[tuple[Sequence, int]]) -> list[torch.Tensor | None]:
        """Run the next n prompt tokens of each (sequence, n); per chunk, the logits after it
        when it ends the prompt, else None. Chunks pad to a common width only while that width
        fits in each one's cache row after its cached tokens; the others run in their own
        forwards."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        order = sorted(range(len(chunks)), key=lambda i: -chunks[i][1])
        while order:
            width = chunks[order[0]][1]
            # Padding runs at positions past a chunk's end: they must exist (cache, RoPE table).
            end = min(kv.capacity, self.max_positions)
            group = [i for i in order if chunks[i][0].num_computed + width <= end]
            group = group or order[:1]
            order = [i for i in order if i not in group]
            seqs = [chunks[i][0] for i in group]
            ids = [s.prefill_ids[s.num_computed : s.num_computed + chunks[i][1]]
                   for s, i in zip(seqs, group)]  # fmt: skip
            logits = self.forward_chains(kv, seqs, ids, [s.num_computed for s in seqs])
            for s, i, chain, lg in zip(seqs, group, ids, logits):
                s.num_computed += len(chain)
                if s.prefilled:
                    out[i] = lg
        return out

    def forward_chains(self, kv, seqs: list[Sequence], chains: list[list[int]],
                       prefix: list[int]) -> torch.Tensor:  # fmt: skip
        """Causal chains of tokens (right-padded) after each sequence's `prefix` cached tokens;
        the logits [B, V] after each chain's last token."""
        dev = self.device
        T = max(len(c) for c in chains)
        steps = torch.arange(T)
        lengths = torch.tensor([len(c) for c in chains])
        valid = steps < lengths[:, None]
        # Real tokens never see padding; a padding token sees itself too, so no row of the
        # attention is empty (its output is never used, but its K/V must stay finite).
        mask = (steps[None, :] <= steps[:, None]) & (
            valid[:, None, :] | torch.eye(T, dtype=torch.bool)
        )
        prefix_t = torch.tensor(prefix)
        positions = prefix_t[:, None] + steps
        hidden = self.graphs(_pad(chains, 0, dev), positions.to(dev), kv.kv, kv.table(seqs),
                             prefix_t.to(dev), mask.to(dev))  # fmt: skip
        last = hidden[torch.arange(len(chains), device=dev), (lengths - 1).to(dev)]
        return self.model.compute_logits(last)

    def decode(self, kv, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence (its newest); logits [B, V]."""
        return self.forward_chains(kv, seqs, [[s.output_ids[-1]] for s in seqs],
                                   [s.num_tokens - 1 for s in seqs])  # fmt: skip

    def tree(self, kv, seqs: list[Sequence], trees: list[TokenTree]) -> torch.Tensor:
        """Every tree's nodes in one forward: node i at slot prefix + i, RoPE position prefix +
        depth, seeing the cached prefix and its own ancestors. Logits [B, T, V]."""
        dev = self.device
        T = max(len(tree) for tree in trees)
        prefix = [s.num_tokens - 1 for s in seqs]
        mask = torch.zeros(len(seqs), T, T, dtype=torch.bool)
        for b, tree in enumerate(trees):
            mask[b, : len(tree), : len(tree)] = tree.ancestor_mask()
        positions = [[p + d for d in tree.depths] + [p] * (T - len(tree))
                     for p, tree in zip(prefix, trees)]  # fmt: skip
        hidden = self.graphs(_pad([tree.tokens for tree in trees], 0, dev),
                             torch.tensor(positions, device=dev), kv.kv, kv.table(seqs),
                             torch.tensor(prefix, device=dev), mask.to(dev))  # fmt: skip
        return self.model.compute_logits(hidden)


def _pad(seqs: list[list[int]], value: int, device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], device=device)
