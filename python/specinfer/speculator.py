"""The speculator: a small speculative model (SSM) that drafts a token tree per request.

The SSM keeps its own KV cache, with the same row per request as the target's and the same slot
layout: the root (the request's newest token) sits at slot `prefix = len(tokens) - 1` and tree node
i at `prefix + i`. So after verification the same depth-first commit (of the accepted path in the
SSM's own node ids) serves both caches. The SSM runs one batched forward per tree depth over that depth's nodes, each seeing the
committed prefix plus its own ancestors (the generalised tree mask covers the earlier levels).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from specinfer import ops
from specinfer.graphs import GraphRunner
from specinfer.kv_cache import kept_capacity
from specinfer.layers import Projection
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
    if hasattr(target, "layer_selected"):  # a sharded target (distributed.ssm_view)
        return target.layer_selected(num_layers)
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
        self.run_model = GraphRunner(model)
        self.tree = tree
        self.name = name
        self.sized = False  # drafts to the depth the budget chooses (drafting.SIZED_TREE)
        self.kv = None
        self.cached: list[int] = []  # per cache row: tokens of the request in the SSM's cache
        self.head_ids: torch.Tensor | None = None  # the LM head's vocabulary subset, if any
        self.head_weight: torch.Tensor | None = None
        self.int8 = False  # drafts through 8-bit codes (quantize_int8)
        self.head_codes = None  # (codes, scale) of head_weight when int8
        self.head_packed = None  # head_weight in panels otherwise, where this CPU prefers them
        self.shares_target = False  # its layers are the target's (layer_selected)
        # Per cache row: the last draft's nodes the SSM ran (has K/V for), root included.
        self.fed: dict[int, set[int]] = {}

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def samples_children(self) -> bool:
        """Whether sampling requests' trees get sampled children (which must stay whole)."""
        return self.tree.sample_children

    def restrict_head(self, token_ids: list[int] | None) -> None:
        """Compute logits only for these tokens (None: the whole vocabulary). The head's rows
        are gathered once; on a small model the full head is most of a step's cost.

        Still lossless: greedy verification accepts any proposal the target agrees with, and
        for sampling the proposal distribution is the softmax over the subset (zero elsewhere),
        a valid distribution the verifier is given exactly."""
        if token_ids is None:
            self.head_ids = self.head_weight = None
        else:
            weight = self.model.lm_head.weight
            self.head_ids = torch.tensor(token_ids, device=weight.device)
            self.head_weight = ops.weight_rows(weight.detach(), self.head_ids).contiguous()
        self._prepare_head()

    def quantize_int8(self) -> None:
        """Draft through 8-bit codes of the SSM's own projections and of its restricted LM head
        (ops.linear_int8): drafting streams these weights from memory at every level, so this
        halves most of its cost. Lossless all the same (verification decides), though the
        drafts may differ slightly. Not for a layer-selected SSM: its layers are the target's."""
        if self.shares_target:
            raise ValueError(f"{self.name} shares the target's layers: they cannot be quantized")
        for module in self.model.modules():
            if isinstance(module, Projection) and module.quantizable:
                module.quantize_int8()
        self.int8 = True
        self._prepare_head()

    def _prepare_head(self) -> None:
        """The restricted head's fastest form: 8-bit codes when drafting int8, else panels where
        this CPU's linear prefers them (ops.pack_linear); head_weight [V', H] stays the source."""
        w = self.head_weight
        self.head_codes = ops.quantize_int8(w) if self.int8 and w is not None else None
        plain = w is not None and self.head_codes is None
        self.head_packed = ops.pack_linear(w) if plain else None

    def reset(self, rows: int, max_seq_len: int) -> None:
        """A new batch: keep the cache (and the graphs recorded over it) if it is large enough."""
        if self.kv is None or not self.kv.holds(rows, max_seq_len):
            self.kv = self.model.make_kv_cache(rows, kept_capacity(max_seq_len))
        self.cached = [0] * self.kv.rows

    def release(self) -> None:
        """Drop the KV cache kept between batches and the graphs recorded over it."""
        self.kv = None
        self.run_model.release()

    def admit(self, row: int) -> None:
        """A new request takes `row`: nothing of it is cached yet."""
        self.cached[row] = 0

    def prefill(self, batch: list, tokens: list[list[int]]) -> None:
        """Feed each request's `tokens` (what the target has cached once its prompt is
        prefilled) past what the SSM has: a draft then feeds only the tokens accepted since,
        so drafting times (which the budget prices) measure drafting, not prompts."""
        todo = [b for b, (r, seq) in enumerate(zip(batch, tokens)) if len(seq) > self.cached[r.row]]
        if not todo:
            return
        row_ids = [batch[b].row for b in todo]
        rows = torch.tensor(row_ids, device=self.kv.k[0].device)
        cached = [self.cached[row] for row in row_ids]
        self._last_hidden(rows, [tokens[b][c:] for b, c in zip(todo, cached)], cached)
        for row, b in zip(row_ids, todo):
            self.cached[row] = len(tokens[b])

    def rollback(self, row: int, length: int) -> None:
        """Forget what the request's row holds past its first `length` tokens (DSI: drafts a
        rejection left behind)."""
        self.cached[row] = min(self.cached[row], length)

    def backlog(self, batch: list, tokens: list[list[int]]) -> int:
        """Tokens of these requests (tokens[b]: request b's whole sequence) that a draft would
        feed before each request's last: what was accepted since its last draft, or all it
        skipped (prompt included) while the budget had it stopped."""
        return sum(max(0, len(seq) - 1 - self.cached[r.row]) for r, seq in zip(batch, tokens))

    def draft(self, batch: list, tokens: list[list[int]], max_depths: list[int]) -> list[TokenTree]:
        """Draft one tree per request. `batch[b]` has .row, .params, .generator, .penalties and
        .output_ids; tokens[b] is its whole sequence; max_depths[b] caps its depth. A request
        of depth 0 gets its root alone and the SSM skips it: what it missed is fed at its next
        draft."""
        live = [b for b, d in enumerate(max_depths) if d > 0]
        if len(live) < len(batch):
            trees = [TokenTree(seq[-1]) for seq in tokens]
            if live:
                drafted = self.draft([batch[b] for b in live], [tokens[b] for b in live],
                                     [max_depths[b] for b in live])  # fmt: skip
                for b, tree in zip(live, drafted):
                    trees[b] = tree
            return trees
        dev = self.kv.k[0].device
        B = len(batch)
        row_ids = [r.row for r in batch]
        rows = torch.tensor(row_ids, device=dev)
        # Level 0: feed what the SSM has not seen yet (the root, and tokens accepted last step).
        pending = [seq[self.cached[row] :] for row, seq in zip(row_ids, tokens)]
        last = self._last_hidden(rows, pending, [self.cached[row] for row in row_ids])
        self._root_outputs(rows, last)
        logits = list(self._logits(last).split(1))
        for row, seq in zip(row_ids, tokens):
            self.cached[row] = len(seq)
        trees = [TokenTree(seq[-1]) for seq in tokens]
        roots = torch.tensor([len(seq) - 1 for seq in tokens], device=dev)
        # ancestors[b, i, j]: node j is node i or one of its ancestors (node 0, the root, always)
        size = 2 * self.tree.num_nodes  # node ids, padding of the widest level included
        ancestors = torch.zeros(B, size, size, dtype=torch.bool)
        ancestors[:, :, 0] = True
        frontier = [range(1) for _ in batch]  # node ids of each tree's nodes to expand next
        paths = [[1.0] for _ in batch]  # per tree, per node: the SSM's path probability
        for row in row_ids:
            self.fed[row] = {0}
        for depth, width in enumerate(self.tree.widths, start=1):
            live = [b for b in range(B) if depth <= max_depths[b]]
            if not live:
                break
            for b in live:
                r, tree, nodes = batch[b], trees[b], list(frontier[b])
                # The request's penalties apply to the SSM's logits as to the target's (each
                # node's by its own path): its proposals then avoid what the target's penalised
                # logits avoid, and a sampled child's recorded q is what it was drawn from.
                lg = logits[b]
                if r.penalties.active:
                    lg = r.penalties.apply(lg, r.output_ids, tree.branches(nodes), self.head_ids)
                if r.grammar is not None:  # so do a structured output's masks
                    lg = r.grammar.mask_nodes(lg, tree, nodes, self.head_ids)
                start = len(tree)
                self._expand(tree, nodes, lg, width, r.params, r.generator, paths[b])
                frontier[b] = range(start, len(tree))
            self._add_level(ancestors, trees, frontier, live)
            if self.tree.beam is not None:  # the level's likeliest come first (_expand)
                frontier = [range(f.start, min(f.stop, f.start + self.tree.beam))
                            for f in frontier]  # fmt: skip
            # Leaves (the last level, or the request's depth cap) need no SSM step.
            live = [b for b in live if depth < min(self.tree.depth, max_depths[b])]
            if not live:
                break
            hidden = self._forward_level(rows[live], [trees[b] for b in live], ancestors[live],
                                         [frontier[b] for b in live], roots[live], depth)  # fmt: skip
            for b in live:
                self.fed[row_ids[b]].update(frontier[b])
            sizes = [len(frontier[b]) for b in live]
            if all(n == hidden.shape[1] for n in sizes):  # no padding rows: all of them in order
                picked = hidden.flatten(0, 1)
            else:
                picked = hidden[
                    torch.tensor([i for i, n in enumerate(sizes) for _ in range(n)], device=dev),
                    torch.tensor([t for n in sizes for t in range(n)], device=dev),
                ]
            for b, lg in zip(live, self._logits(picked).split(sizes)):
                logits[b] = lg
        return trees

    def commit(self, batch: list, prefix: list[int], paths: list[list[int]], trees: list[TokenTree],
               max_depths: list[int]) -> None:  # fmt: skip
        """Keep the accepted nodes the SSM has K/V for (all but leaves at its last depth).
        Requests it skipped (depth 0) keep what they had."""
        live = [b for b, d in enumerate(max_depths) if d > 0]
        if not live:
            return
        rows, starts = [batch[b].row for b in live], [prefix[b] for b in live]
        kept = [[n for n in paths[b] if n in self.fed[row]] for b, row in zip(live, rows)]
        dev = self.kv.k[0].device
        args = torch.tensor(rows, device=dev), torch.tensor(starts, device=dev), _pad(kept, -1, dev)
        if hasattr(self.model, "commit_kv"):  # its cache is sharded over ranks (MirroredSSM)
            self.model.commit_kv(self.kv, *args)
        else:
            ops.kv_commit(self.kv.k + self.kv.v, *args)
        for row, start, k in zip(rows, starts, kept):
            self.cached[row] = start + len(k)

    # -- internals ------------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary (all tokens, or the restricted subset), in the
        model's dtype: top-k reads it as it is, and sampling makes its distribution in float32."""
        if self.head_weight is None:
            return self.model.compute_logits(hidden)
        if self.head_codes is not None:
            return ops.linear_int8(hidden, *self.head_codes)
        if self.head_packed is not None:
            return ops.linear(hidden, self.head_packed)
        return ops.linear(hidden, self.head_weight)

    def _expand(self, tree: TokenTree, nodes: list[int], logits: torch.Tensor, width: int,
                params: SamplingParams, generator: torch.Generator,
                paths: list[float]) -> None:  # fmt: skip
        """Give each of `nodes` its children; logits[i] is the SSM's prediction after nodes[i];
        paths[n]: node n's path probability (the new nodes' appended)."""
        if params.greedy or not self.tree.sample_children:
            # Deterministic top-k: each child is a point-mass proposal, proposed likeliest
            # path first (a node's children stay best first), so a beam is the level's start.
            k = min(width, logits.shape[-1])
            tokens, probs = ops.topk_expand(logits, k, params.temperature)
            children = [
                (paths[node] * p, node, t, p)
                for node, row, ps in zip(nodes, self._vocab_ids(tokens).tolist(), probs.tolist())
                for t, p in zip(row, ps)
            ]
            if self.tree.beam is not None:
                children.sort(key=lambda c: -c[0])  # stable: ties keep the parents' order
            for path, node, t, p in children:
                if tree.propose(node, t, conf=p) == len(paths):
                    paths.append(path)
            return
        q = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
        draws = self._vocab_ids(torch.multinomial(q, width, replacement=True, generator=generator))
        for node, q_node, row in zip(nodes, self._full_vocab(q), draws.tolist()):
            q_row = tree.add_distribution(q_node)
            for t in row:
                tree.propose(node, t, q_row)

    def _vocab_ids(self, head_indices: torch.Tensor) -> torch.Tensor:
        return head_indices if self.head_ids is None else self.head_ids[head_indices]

    def _full_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Distributions over the head's subset, as distributions over the whole vocabulary."""
        if self.head_ids is None:
            return q
        full = q.new_zeros(q.shape[0], self.model.config.vocab_size)
        return full.index_copy_(1, self.head_ids, q)

    @staticmethod
    def _add_level(ancestors: torch.Tensor, trees: list[TokenTree], frontier: list[range],
                   live: list[int]) -> None:  # fmt: skip
        """A new node's ancestors are its parent's, plus itself."""
        b = torch.tensor([b for b in live for _ in frontier[b]], dtype=torch.long)
        nodes = torch.tensor([n for b in live for n in frontier[b]], dtype=torch.long)
        parents = torch.tensor([trees[b].parents[n] for b in live for n in frontier[b]])
        ancestors[b, nodes] = ancestors[b, parents]
        ancestors[b, nodes, nodes] = True

    def _last_hidden(self, rows, pending: list[list[int]], cached: list[int]) -> torch.Tensor:
        """Hidden state [B, H] after each request's pending tokens. Chains run together, padded
        to the longest, when that fits in each one's cache row after its cached tokens and the
        padding at most doubles their work (or they are all short, as a step's are): a new
        request's prompt runs apart from the one or two tokens of the others."""
        last = [None] * len(pending)
        order = sorted(range(len(pending)), key=lambda b: -len(pending[b]))
        short = self.tree.depth + 1
        # Padding runs at positions past a chain's end: they must exist (cache, RoPE table).
        end = min(self.kv.max_seq_len, self.model.config.max_position_embeddings)
        while order:
            width = len(pending[order[0]])
            group = [b for b in order if cached[b] + width <= end
                     and (2 * len(pending[b]) >= width or width <= short)]  # fmt: skip
            group = group or order[:1]
            order = [b for b in order if b not in group]
            hidden = self._forward(
                rows[group], [pending[b] for b in group], [cached[b] for b in group]
            )
            for i, b in enumerate(group):
                last[b] = hidden[i, len(pending[b]) - 1]
        return torch.stack(last)

    def _forward(self, rows, chains: list[list[int]], prefix: list[int]) -> torch.Tensor:
        """Run right-padded token chains (causal) after each request's prefix."""
        dev = rows.device
        T = max(len(c) for c in chains)
        ids = _pad(chains, 0, dev)
        steps = torch.arange(T, device=dev)
        valid = steps < torch.tensor([len(c) for c in chains], device=dev)[:, None]
        mask = (steps[None, :] <= steps[:, None]) & valid[:, None, :] & valid[:, :, None]
        prefix_t = torch.tensor(prefix, device=dev)
        positions = prefix_t[:, None] + steps
        return self._run_chains(ids, positions, rows, prefix_t, mask)

    def _forward_level(self, rows, trees: list[TokenTree], ancestors: torch.Tensor,
                       levels: list[range], roots: torch.Tensor, depth: int) -> torch.Tensor:  # fmt: skip
        """Run one depth's nodes (numbered consecutively); node i of a tree lives at slot
        root + i. The mask's M columns end at the level's last slot; node ids <= 0 there are
        the root or committed tokens, visible to all."""
        dev = rows.device
        T = max(len(lv) for lv in levels)
        firsts = torch.tensor([lv.start for lv in levels])
        M = int(firsts.max()) - 1 + T
        if len(levels) == 1:  # one tree: its rows and columns are ranges (a slice, fewer ops)
            mask = ancestors[:, M + 1 - T : M + 1, 1 : M + 1]
        else:
            node = firsts[:, None] + torch.arange(T)  # padding rows see the committed prefix only
            column = (firsts[:, None] + T - M + torch.arange(M)).clamp(min=0)
            b = torch.arange(len(levels))[:, None, None]
            mask = ancestors[b, node[:, :, None], column[:, None, :]]
        ids = _pad([[tree.tokens[n] for n in lv] for tree, lv in zip(trees, levels)], 0, dev)
        prefix = roots + firsts.to(dev)
        return self._run_level(ids, roots[:, None].expand(-1, T) + depth, rows, prefix,
                               mask.to(dev), trees, levels)  # fmt: skip

    # The model calls, which a feature head (FeatureSpeculator) extends with its feature inputs.

    def _run_chains(self, ids, positions, rows, prefix, mask) -> torch.Tensor:
        """Hidden states [B, T, H] of token chains at slots prefix + t (level 0, prefill)."""
        return self.run_model(ids, positions, self.kv, rows, prefix, mask)

    def _run_level(self, ids, positions, rows, prefix, mask, trees, levels) -> torch.Tensor:
        """Hidden states [B, T, H] of one tree level: levels[b] (node ids) of trees[b]."""
        return self.run_model(ids, positions, self.kv, rows, prefix, mask)

    def _root_outputs(self, rows, hidden: torch.Tensor) -> None:
        """Level 0's hidden state after each root [B, H] (a feature head feeds it on)."""


def load_speculator(
    spec, target: nn.Module, target_path: Path, tree: TreeConfig, dtype, device,
    feature: bool = False,
) -> Speculator:  # fmt: skip
    """`spec`: an int L / "layers:L" (the target's first L layers), or a model path (an SSM, or
    a feature head: `specinfer train-ssm --kind feature`; `feature` requires one)."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.startswith("layers:")):
        n = spec if isinstance(spec, int) else parse_layers(spec)
        ssm = Speculator(layer_selected(target, n), tree, name=f"layers:{n}")
        ssm.shares_target = True
        return ssm
    from specinfer.feature_speculator import FeatureSpeculator
    from specinfer.loader import load_model

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"SSM not found: {path} (a model path, or layers:L for a layer-selected SSM)"
        )
    # A compact export (no embeddings of its own) shares the target's embedding and LM head.
    model = load_model(path, dtype=dtype, device=device, shared_embeddings_from=target)
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"SSM {path.name} has vocabulary size {model.config.vocab_size}, the target "
            f"{target_path.name} has {target.config.vocab_size}: they must share a tokenizer"
        )
    if model.config.architecture == "feature":
        layers, n = model.config.feature_layers, target.config.num_layers
        tappable = target.config.architecture == "llama" and all(0 <= i < n for i in layers)
        if layers and not tappable:
            raise ValueError(f"feature head {path.name} reads target layers {list(layers)}: the "
                             f"target ({target.config.architecture}, {n} layers) has no such "
                             "layers to tap")  # fmt: skip
        return FeatureSpeculator(model, tree, name=f"feature:{path.name}")
    if feature:
        raise ValueError(f"{path} is not a feature head (its config.json says "
                         f"{model.config.architecture!r}); train one with train-ssm --kind feature")  # fmt: skip
    return Speculator(model, tree, name=path.name)


def parse_layers(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"expected layers:L with an integer L, got {spec!r}") from None


def _pad(seqs: list[list[int]], value: int, device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], device=device)
