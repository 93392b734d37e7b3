"""A feature head (models/feature_head.py) as a drafter: the Speculator, fed the target's features.

Each token the head reads comes with the feature before it: the target's final hidden state at
the slot before (with the inputs of the target layers the head reads, if any, reduced to one;
true features, which the target's forwards hand over through `write_features`: prompt chunks,
decode steps, and the accepted path of each verified tree), or inside a draft the head's own
output at the node's parent (its guess of that feature).

So the head's KV cache keeps only entries made from true features: after verification it keeps
the root's (its input was the target's feature) and drops the tree's, and its next draft feeds
the accepted tokens again, now with the target's features for them (as EAGLE does).

With prefix caching the features are also kept by the target's KV blocks (`keep_by_block`), as
long as the blocks' K/V: a request that takes cached blocks gets their features copied into its
row, since the target's forward never ran over those tokens for it.
"""

from __future__ import annotations

import torch

from specinfer.kv_cache import zeros
from specinfer.speculator import Speculator


class FeatureSpeculator(Speculator):
    reads_features = True  # the engine hands it the target's hidden states

    def __init__(self, model, tree, name: str = "feature"):
        super().__init__(model, tree, name)
        # [rows, 1 + slots, H]: the target's hidden state at slot s in column s + 1, so column t
        # holds what the token at slot t reads (zeros at 0: slot 0 has no feature before it).
        self.features = None
        self.drafted = None  # [rows, nodes, H]: the head's output at each node of its last draft
        self.by_block = None  # [blocks, block_len, H]: the features at each slot of each block
        self.filled: list[int] = []  # per row: the slots from 0 whose features it holds

    def reset(self, rows: int, max_seq_len: int) -> None:
        kv = self.kv
        super().reset(rows, max_seq_len)
        if self.kv is not kv or self.features is None:
            rows, H = self.kv.rows, self.model.config.hidden_size
            like = {"dtype": self.model.fc.weight.dtype, "device": self.kv.k[0].device}
            self.features = zeros((rows, 1 + self.kv.max_seq_len, H), **like)
            self.drafted = torch.zeros(rows, 2 * self.tree.num_nodes, H, **like)
        self.filled = [0] * self.kv.rows

    def keep_by_block(self, blocks: int, block_len: int) -> None:
        """Keep the features by the target's KV blocks too (prefix caching)."""
        like = {"dtype": self.features.dtype, "device": self.features.device}
        self.by_block = zeros((blocks, block_len, self.features.shape[-1]), **like)

    def release(self) -> None:
        super().release()
        self.features = self.drafted = self.by_block = None

    def admit(self, row: int) -> None:
        super().admit(row)
        self.filled[row] = 0

    def write_features(self, batch: list, prefix: list[int], hidden: torch.Tensor,
                       lengths: list[int]) -> None:  # fmt: skip
        """The target's features hidden[b, :lengths[b]] belong to slots prefix[b] + t of request
        batch[b] (tokens it has cached, or a verified path it keeps)."""
        end = self.features.shape[1] - 1
        reduced = self.model.reduce(hidden)
        for b, (r, start, n) in enumerate(zip(batch, prefix, lengths)):
            n = min(n, end - start)
            if n <= 0:
                continue
            if self.by_block is not None:
                flat = self.by_block.view(-1, self.by_block.shape[-1])
                filled = self.filled[r.row]
                if start > filled:  # slots of cached blocks it took
                    self.features[r.row, filled + 1 : start + 1] = flat[
                        self._slots(r, filled, start)
                    ]
                flat[self._slots(r, start, start + n)] = reduced[b, :n]
                self.filled[r.row] = max(filled, start + n)
            self.features[r.row, start + 1 : start + 1 + n] = reduced[b, :n]

    def _slots(self, seq, start: int, stop: int) -> torch.Tensor:
        """Where slots start..stop-1 of `seq` are in by_block viewed [blocks x block_len, H]."""
        n = self.by_block.shape[1]
        return torch.tensor([seq.blocks[s // n] * n + s % n for s in range(start, stop)],
                            device=self.by_block.device)  # fmt: skip

    def commit(self, batch, prefix, paths, trees, max_depths) -> None:
        """Nothing of the tree is kept: its entries came from the head's guessed features. The
        draft left each drafted request's cache at its root, whose input was true."""

    def _run_chains(self, ids, positions, rows, prefix, mask) -> torch.Tensor:
        # A chain's positions are its slots (prefix + t): the columns of the features before them.
        feats = self.features[rows[:, None], positions]
        return self._run(ids, feats, positions, rows, prefix, mask)

    def _run_level(self, ids, positions, rows, prefix, mask, trees, levels) -> torch.Tensor:
        dev, T = ids.device, ids.shape[1]
        # Node ids continue past a short level's end (padding, as in _forward_level).
        nodes = [range(lv.start, lv.start + T) for lv in levels]
        parents = [[tree.parents[n] if n < lv.stop else 0 for n in ns]
                   for tree, lv, ns in zip(trees, levels, nodes)]  # fmt: skip
        at = rows[:, None]
        feats = self.drafted[at, torch.tensor(parents, device=dev)]
        hidden = self._run(ids, feats, positions, rows, prefix, mask)
        self.drafted[at, torch.tensor([list(ns) for ns in nodes], device=dev)] = hidden
        return hidden

    def _root_outputs(self, rows, hidden: torch.Tensor) -> None:
        self.drafted[rows, 0] = hidden

    def _run(self, ids, feats, positions, rows, prefix, mask) -> torch.Tensor:
        h = self.model.fuse(ids, feats)
        return self.run_model.embedded(h, positions, self.kv, rows, prefix, mask)
