"""The target model's forwards for one step: prompt chunks, decode tokens, token trees.

It owns the model, its KV cache and the op graphs recorded over it (graphs.py); each forward
takes the sequences' block tables and their tokens, and returns logits. A sequence's new tokens
go to the slots right after its cached ones; every row of a batch is padded to the same width
and its padding masked out (the kernels compute a row the same way whatever rows share the call).

Under tensor and pipeline parallelism every rank runs a ModelRunner over its shard: rank 0's
sends each call of the primitives below (`make_cache`, `forward`, `commit`, `release`,
`embeddings`: plain tensors, no sequences) to the workers (distributed.workers) before running
it itself, so all ranks run the same ops and meet in the same collectives. With pipeline
stages, a forward splits the batch into micro-batches that flow stage to stage (hidden states
and the residual stream by point-to-point sends), so the stages work at once; the last stage's
logits come back to rank 0. Every stage commits the accepted paths into its own layers' cache.
"""

from __future__ import annotations

import torch
from torch import nn

from specinfer import ops
from specinfer.engine.sequence import Sequence
from specinfer.graphs import GraphRunner
from specinfer.models.feature_head import target_features
from specinfer.tree import TokenTree

# Padding rows a prompt chunk may take to share a forward with longer ones, on a CPU: there a
# row costs what it computes (~2 ms here past a few rows) and a forward's fixed cost is a few
# rows'. Padded to the longest, 32 held-out prompts served 16 at a time ran 1.5x their rows
# (their prefill 13-26% slower). A GPU computes padding nearly free: chunks always share.
PREFILL_PADDING = 8


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, workers=None, parallel=None):
        """workers: rank 0's handle on the other ranks (distributed.Workers); parallel: a
        worker's place among the ranks (distributed.group.Parallel); None for both alone."""
        self.model, self.device, self.workers = model, device, workers
        self.par = parallel or (workers.group if workers else None)
        self.graphs = GraphRunner(model)
        self.max_positions = model.config.max_position_embeddings
        self.cache = None
        self.ssm_views, self.ssm_caches = {}, {}  # layer-selected SSMs (see ssm_cache)
        self.streamer = getattr(model, "layer_streamer", None)  # offloaded layers (offload.py)
        self.forwards = 0  # target forwards run (rank 0)
        # A feature-level draft head's input: called (sequences, first slots, features [B, T, F],
        # lengths) with the features of the tokens each forward keeps: the final hidden states,
        # after the kept inputs of the layers the model taps (LlamaForCausalLM.tap), if any.
        self.feature_sink = None
        self.hidden = None  # the last forward's features, while a feature sink is set

    # --- primitives: what every rank runs ---

    def _call(self, op: str, *args):
        if self.workers is None:
            return getattr(self, op)(*args)
        sent = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        return self.workers.run(op, sent, lambda: getattr(self, op)(*args))

    def make_cache(self, blocks: int, block_len: int):
        self.cache = self.model.make_kv_cache(blocks, block_len)
        return self.cache

    def forward(self, tokens, positions, table, prefix, mask, last) -> torch.Tensor | None:
        """Logits of every row [B, T, V], or with `last` [B] of row last[b] only [B, V] (on
        rank 0; None on the other pipeline stages)."""
        if self.par is not None and self.par.pp > 1:
            return self._pipelined(tokens, positions, table, prefix, mask, last)
        dev = self.device
        hidden = self.graphs(tokens.to(dev), positions.to(dev), self.cache, table.to(dev),
                             prefix.to(dev), mask.to(dev))  # fmt: skip
        if self.feature_sink is not None:
            self.hidden = target_features(hidden, self.graphs.taps)
        if last is not None:
            hidden = hidden[torch.arange(len(last), device=dev), last.to(dev)]
        return self.model.compute_logits(hidden)

    def commit(self, table, prefix, accepted) -> None:
        """Move each accepted path's K/V to the slots after its prefix (ops.kv_commit)."""
        dev = self.device
        held = self.cache.held  # a pipeline stage's layers
        caches = [self.cache.k[i] for i in held] + [self.cache.v[i] for i in held]
        ops.kv_commit(caches, table.to(dev), prefix.to(dev), accepted.to(dev))

    def release(self) -> None:
        self.graphs.release()
        self.cache = None

    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole embedding and LM head weights (gathered from the shards; the head comes
        from the last pipeline stage), on rank 0."""

        def whole(layer) -> torch.Tensor | None:
            w = layer.weight
            if w.is_meta:  # another stage's
                return None
            return torch.cat(layer.tp.all_gather(w), dim=0) if layer.tp.size > 1 else w

        embed, head = self.model.model.embed_tokens, self.model.lm_head
        full = whole(embed)
        if head.weight is embed.weight:
            return full, full
        head_w, par = whole(head), self.par
        if par is not None and par.pp > 1:
            if par.last and par.tp.rank == 0:
                par.send_tensor(head_w, 0, tag=0).wait()
            if par.rank == 0:
                shape = (self.model.config.vocab_size, embed.weight.shape[1])
                head_w = par.recv_tensor(shape, embed.weight.dtype, par.rank_of(par.pp - 1), 0)
        return full, head_w

    # A layer-selected SSM over a tensor-parallel target (distributed.MirroredSSM): its first
    # n layers are this rank's shards; each rank keeps the SSM's cache for them.

    def ssm_cache(self, n: int, rows: int, max_seq_len: int):
        self.ssm_caches[n] = self._ssm(n).make_kv_cache(rows, max_seq_len)
        return self.ssm_caches[n]

    def ssm_forward(self, n: int, tokens, positions, rows, prefix, mask) -> torch.Tensor:
        dev = self.device
        return self._ssm(n)(tokens.to(dev), positions.to(dev), self.ssm_caches[n], rows.to(dev),
                            prefix.to(dev), mask.to(dev))  # fmt: skip

    def ssm_commit(self, n: int, rows, prefix, accepted) -> None:
        kv, dev = self.ssm_caches[n], self.device
        ops.kv_commit(kv.k + kv.v, rows.to(dev), prefix.to(dev), accepted.to(dev))

    def _ssm(self, n: int):
        from specinfer.speculator import layer_selected

        if n not in self.ssm_views:
            self.ssm_views[n] = layer_selected(self.model, n)
        return self.ssm_views[n]

    def _pipelined(self, tokens, positions, table, prefix, mask, last):
        """This stage's part of a forward, micro-batch by micro-batch (see the docstring)."""
        par, model, dev = self.par, self.model, self.device
        B, T = tokens.shape
        shape, dtype = (T, model.config.hidden_size), self.cache.k[self.cache.held[0]].dtype
        bounds = torch.linspace(0, B, min(par.pp, B) + 1).round().long().tolist()
        sent, logits = [], []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            args = [x[lo:hi].to(dev) for x in (positions, table, prefix, mask)]
            if par.first:
                h, residual = model.embed(tokens[lo:hi].to(dev)), None
            else:
                src = par.rank_of(par.stage - 1)
                h = par.recv_tensor((hi - lo, *shape), dtype, src, 2 * i).to(dev)
                residual = par.recv_tensor((hi - lo, *shape), dtype, src, 2 * i + 1).to(dev)
            pos, rows, pre, msk = args
            h, residual = model.run_stage(h, residual, pos, self.cache, rows, pre, msk)
            if not par.last:  # on to the next stage; this stage starts the next micro-batch
                dst = par.rank_of(par.stage + 1)
                sent += [(par.send_tensor(h, dst, 2 * i), h),
                         (par.send_tensor(residual, dst, 2 * i + 1), residual)]  # fmt: skip
                continue
            out = model.model.norm(h, residual)
            if last is not None:
                out = out[torch.arange(hi - lo, device=dev), last[lo:hi].to(dev)]
            logits.append(model.compute_logits(out))
        for work, _ in sent:
            work.wait()
        if par.last:
            if par.tp.rank == 0:
                par.send_tensor(torch.cat(logits), 0, tag=0).wait()
            return None
        if par.rank != 0:
            return None
        vocab = model.config.vocab_size
        out_shape = (B, vocab) if last is not None else (B, T, vocab)
        return par.recv_tensor(out_shape, torch.float32, par.rank_of(par.pp - 1), 0).to(dev)

    # --- rank 0: sequences to primitives ---

    def new_cache(self, blocks: int, block_len: int):
        return self._call("make_cache", blocks, block_len)

    def free_cache(self) -> None:
        self._call("release")

    def gather_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call("embeddings")

    def prefill(self, kv, chunks: list[tuple[Sequence, int]]) -> list[torch.Tensor | None]:
        """Run the next n prompt tokens of each (sequence, n); per chunk, the logits after it
        when it ends the prompt, else None, or for a sequence that scores its prompt
        (`Sequence.scores_prompt`) the logits after each of its n tokens [n, V]. Chunks pad to a
        common width only while that width fits in each one's cache row after its cached
        tokens, and (on a CPU) while a chunk's padding stays within PREFILL_PADDING rows; the
        others run in their own forwards, as do the scoring chunks (their every row takes the
        LM head, which the others need at their last row only)."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        order = sorted(range(len(chunks)), key=lambda i: -chunks[i][1])
        slack = PREFILL_PADDING if self.device.type == "cpu" else None
        while order:
            width, scoring = chunks[order[0]][1], chunks[order[0]][0].scores_prompt
            # Padding runs at positions past a chunk's end: they must exist (cache, RoPE table).
            end = min(kv.capacity, self.max_positions)
            group = [i for i in order if chunks[i][0].num_computed + width <= end
                     and (slack is None or width - chunks[i][1] <= slack)
                     and chunks[i][0].scores_prompt == scoring]  # fmt: skip
            group = group or order[:1]
            order = [i for i in order if i not in group]
            seqs = [chunks[i][0] for i in group]
            ids = [s.prefill_ids[s.num_computed : s.num_computed + chunks[i][1]]
                   for s, i in zip(seqs, group)]  # fmt: skip
            logits = self.forward_chains(kv, seqs, ids, [s.num_computed for s in seqs], scoring)
            for s, i, chain, lg in zip(seqs, group, ids, logits):
                s.num_computed += len(chain)
                if scoring:
                    out[i] = lg[: len(chain)]
                elif s.prefilled:
                    out[i] = lg
        return out

    def forward_chains(self, kv, seqs: list[Sequence], chains: list[list[int]],
                       prefix: list[int], every_row: bool = False) -> torch.Tensor:  # fmt: skip
        """Causal chains of tokens (right-padded) after each sequence's `prefix` cached tokens;
        the logits [B, V] after each chain's last token (every_row: after each token,
        [B, T, V])."""
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
        self.forwards += 1
        logits = self._call("forward", _pad(chains, 0), prefix_t[:, None] + steps, kv.table(seqs),
                            prefix_t, mask, None if every_row else lengths - 1)  # fmt: skip
        if self.feature_sink is not None:
            self.feature_sink(seqs, prefix, self.hidden, lengths.tolist())
        return logits

    def decode(self, kv, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence (its newest); logits [B, V]."""
        return self.forward_chains(kv, seqs, [[s.output_ids[-1]] for s in seqs],
                                   [s.num_tokens - 1 for s in seqs])  # fmt: skip

    def tree(self, kv, seqs: list[Sequence], trees: list[TokenTree]) -> torch.Tensor:
        """Every tree's nodes in one forward: node i at slot prefix + i, RoPE position prefix +
        depth, seeing the cached prefix and its own ancestors. Logits [B, T, V]."""
        T = max(len(tree) for tree in trees)
        prefix = [s.num_tokens - 1 for s in seqs]
        mask = torch.zeros(len(seqs), T, T, dtype=torch.bool)
        for b, tree in enumerate(trees):
            mask[b, : len(tree), : len(tree)] = tree.ancestor_mask()
        positions = [[p + d for d in tree.depths] + [p] * (T - len(tree))
                     for p, tree in zip(prefix, trees)]  # fmt: skip
        self.forwards += 1
        return self._call("forward", _pad([tree.tokens for tree in trees], 0),
                          torch.tensor(positions), kv.table(seqs), torch.tensor(prefix), mask,
                          None)  # fmt: skip

    def commit_paths(self, kv, seqs: list[Sequence], prefix: list[int],
                     paths: list[list[int]]) -> None:  # fmt: skip
        """Keep each sequence's accepted tree path (node ids) in its cache after `prefix`, and
        hand the path's hidden states (of the last tree forward) to the feature sink."""
        # Most steps move nothing: no draft accepted, or the path is the tree's first nodes in
        # order (node i at slot i already). A commit costs ~0.1 ms even then (60 caches).
        if any(node != i for path in paths for i, node in enumerate(path)):
            self._call("commit", kv.table(seqs), torch.tensor(prefix), _pad(paths, -1))
        if self.feature_sink is not None:
            at = torch.arange(len(paths), device=self.hidden.device)[:, None]
            hidden = self.hidden[at, _pad(paths, 0).to(self.hidden.device)]
            self.feature_sink(seqs, prefix, hidden, [len(p) for p in paths])

    def streamed(self) -> tuple[int, float, float]:
        """The offloaded layers' (bytes streamed, reading seconds, waiting seconds) so far."""
        s = self.streamer
        return (s.bytes, s.read_s, s.wait_s) if s is not None else (0, 0.0, 0.0)

    def charge_streaming(self, seqs: list[Sequence], since: tuple) -> tuple[int, float, float]:
        """Share what was streamed since `since` among `seqs` (they shared its forwards): their
        weight_bytes, stream_s (reading) and stream_wait_s (forwards waiting for weights)."""
        now = self.streamed()
        if seqs and now != since:
            share = [(a - b) / len(seqs) for a, b in zip(now, since)]
            for s in seqs:
                for key, value in zip(("weight_bytes", "stream_s", "stream_wait_s"), share):
                    s.metrics[key] += value
        return now


def _pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs])
