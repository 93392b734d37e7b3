"""Drafting with several SSMs: each drafts its own tree, the trees merge into one per request.

An SSM here is anything with the Speculator's interface (a neural `Speculator`, the
`NgramDrafter`, the `SuffixDrafter`): num_nodes, reset, admit, prefill, draft, commit, rollback. Each keeps its own per-request state
(KV cache, cached length, n-gram index), so after verification each is told the accepted path in
its own node ids: the longest prefix of the path that is in its tree. Accepted tokens an SSM did
not propose reach it at its next draft (it feeds everything past what it has cached).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specinfer.default_model import (
    DEFAULT_SSM_TREE,
    default_corpus_path,
    default_feature_path,
    default_ssm_path,
)
from specinfer.layers import pack_linears
from specinfer.ngram import NgramConfig, NgramDrafter
from specinfer.speculator import Speculator, load_speculator, parse_layers
from specinfer.suffix import SuffixConfig, SuffixDrafter
from specinfer.tree import TokenTree, TreeConfig, merge_trees

DEFAULT_HEAD = 8192  # tokens of head_tokens.json used when ssm_head is not given
# The tree an SSM given no tree config drafts under the cost-aware budget, to the depth that
# pays each step (budget.TreeBudget.depth); the cut then keeps its nodes that pay. Four
# candidates at the first two levels, two below, and only the SSM's four likeliest nodes of a
# level get children (EAGLE-2's dynamic tree): wide where the SSM is unsure, at four SSM rows
# a level.
SIZED_TREE = TreeConfig((4, 4, 2, 2, 2, 2, 2, 2), max_nodes=80, beam=4)


class Drafter:
    def __init__(self, ssms: list):
        self.ssms = ssms
        self._trees: list[list[TokenTree]] = []  # per SSM, per request: the last drafts
        self._maps: list[list[list[int]]] = []  # per request, per SSM: its node -> merged node
        self._merged: list[TokenTree] = []  # per request: the last merged tree
        self.last_times: list[float] = []  # seconds each SSM took in the last draft

    @property
    def num_nodes(self) -> int:
        """The largest merged tree (the roots coincide)."""
        return 1 + sum(s.num_nodes - 1 for s in self.ssms)

    @property
    def reads_features(self) -> bool:
        """Whether an SSM drafts from the target's hidden states (a feature head)."""
        return any(getattr(s, "reads_features", False) for s in self.ssms)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the feature heads read besides the final hidden state
        (models/feature_head.py); one set for all of them, since they share the features."""
        wanted = {s.model.config.feature_layers for s in self.ssms
                  if getattr(s, "reads_features", False)}  # fmt: skip
        if len(wanted) > 1:
            raise ValueError("feature heads drafting together must read the same target layers; "
                             f"these read {' and '.join(map(str, sorted(wanted)))}")  # fmt: skip
        return next(iter(wanted), ())

    def write_features(self, batch: list, prefix: list[int], hidden, lengths: list[int]) -> None:
        """The target's hidden states of tokens it keeps (see ModelRunner.feature_sink)."""
        for s in self.ssms:
            if getattr(s, "reads_features", False):
                s.write_features(batch, prefix, hidden, lengths)

    def reset(self, rows: int, max_seq_len: int) -> None:
        for s in self.ssms:
            s.reset(rows, max_seq_len)

    def keep_features_by_block(self, blocks: int, block_len: int) -> None:
        """Feature heads keep the target's features by its KV blocks too (prefix caching: a
        cached block's features go with its K/V)."""
        for s in self.ssms:
            if getattr(s, "reads_features", False):
                s.keep_by_block(blocks, block_len)

    def admit(self, row: int) -> None:
        for s in self.ssms:
            s.admit(row)

    def prefill(self, batch: list, tokens: list[list[int]], skip=frozenset()) -> None:
        """Each SSM catches up with the requests whose prompts the target has just cached, but
        those in `skip` (indices; they feed what they lack at their next draft)."""
        for i, s in enumerate(self.ssms):
            if i not in skip:
                s.prefill(batch, tokens)

    def backlog(self, batch: list, tokens: list[list[int]]) -> list[int]:
        """Per SSM, the tokens of these requests it would feed before drafting (see
        Speculator.backlog); prompt lookup reads the tokens as they are: none."""
        return [s.backlog(batch, tokens) if isinstance(s, Speculator) else 0 for s in self.ssms]

    def rollback(self, row: int, length: int) -> None:
        """Every SSM forgets what request `row` holds past its first `length` tokens."""
        for s in self.ssms:
            s.rollback(row, length)

    def draft(self, batch: list, tokens: list[list[int]],
              depths: list[list[int]]) -> list[TokenTree]:  # fmt: skip
        """One merged tree per request; depths[i][b]: SSM i's depth cap for request b (0: that
        SSM does not draft for it)."""
        self._trees, self.last_times, self._depths = [], [], depths
        for s, max_depths in zip(self.ssms, depths):
            t0 = time.perf_counter()
            self._trees.append(s.draft(batch, tokens, max_depths))
            self.last_times.append(time.perf_counter() - t0)
        if len(self.ssms) == 1:
            self._maps = [[list(range(len(t)))] for t in self._trees[0]]
            self._merged = self._trees[0]
        else:
            merged = [merge_trees(list(per_request)) for per_request in zip(*self._trees)]
            self._maps = [maps for _, maps in merged]
            self._merged = [tree for tree, _ in merged]
        return self._merged

    def keep(self, kept: list[list[int]]) -> list[TokenTree]:
        """Cut the last merged trees down to the `kept` nodes of each (see TreeBudget)."""
        trees = []
        for b, nodes in enumerate(kept):
            if len(nodes) == len(self._merged[b]):  # nothing cut: no copy, same node ids
                trees.append(self._merged[b])
                continue
            tree, new_id = self._merged[b].subtree(nodes)
            self._maps[b] = [[new_id[m] for m in own_to_merged] for own_to_merged in self._maps[b]]
            trees.append(tree)
        self._merged = trees
        return trees

    def commit(self, batch: list, prefix: list[int], paths: list[list[int]]) -> None:
        """Tell each SSM the accepted paths (merged node ids) of the last draft."""
        for i, s in enumerate(self.ssms):
            own = [_own_path(path, maps[i]) for path, maps in zip(paths, self._maps)]
            s.commit(batch, prefix, own, self._trees[i], self._depths[i])

    def record(self, metrics: list[dict], paths: list[list[int]]) -> None:
        """Add the last step to each request's per-SSM metrics: the SSM's drafting time (of the
        whole batch, like ssm_s) and how many accepted nodes (root excluded) it proposed."""
        for m, path, maps in zip(metrics, paths, self._maps):
            if not m["per_ssm"]:
                m["per_ssm"] = [{"name": s.name, "ssm_s": 0.0, "accepted": 0} for s in self.ssms]
            for stats, seconds, merged_of in zip(m["per_ssm"], self.last_times, maps):
                stats["ssm_s"] += seconds
                stats["accepted"] += len(_own_path(path, merged_of)) - 1


def _own_path(path: list[int], merged_of: list[int]) -> list[int]:
    """The longest prefix of a merged-tree path that lies in one SSM's tree, in its node ids."""
    own_of = {m: own for own, m in enumerate(merged_of) if m >= 0}
    own = []
    for node in path:
        if node not in own_of:
            break
        own.append(own_of[node])
    return own


def build_drafter(specs, trees, target: nn.Module, target_path: Path, dtype, device,
                  head: int | None, chains: bool, sized: bool = False,
                  int8: bool = False) -> Drafter:  # fmt: skip
    """SSMs from specs (a model path, int L / "layers:L", "default" for the SSM shipped for the
    default model, "feature" for its feature head, "feature:PATH" for another feature head,
    prompt lookup "ngram[:k=v,...]" or earlier requests' continuations "suffix[:k=v,...]"),
    each with its tree config (`trees`: one for all, or a list per SSM; None at the entries of
    the drafters without a model, which take their shape from their spec).
    `head`: the neural SSMs' LM head vocabulary (see `head_token_ids`). `chains`: sequence mode,
    every SSM drafts a chain. `sized`: a neural SSM given no tree drafts SIZED_TREE to the
    depth the cost-aware budget chooses each step (budget.TreeBudget.depth); without it, the
    default SSM drafts DEFAULT_SSM_TREE and the others TreeConfig(). `int8`: the SSMs with
    weights of their own draft through 8-bit copies of them (Speculator.quantize_int8)."""
    specs = list(specs) if isinstance(specs, list | tuple) else [specs]
    if not specs:
        raise ValueError("ssm list is empty")
    if isinstance(trees, list | tuple):
        if len(trees) != len(specs):
            raise ValueError(f"got {len(trees)} tree configs for {len(specs)} SSMs")
    else:
        trees = [trees if not is_lookup_spec(s) else None for s in specs]
    ssms = []
    for spec, tree in zip(specs, trees):
        if is_lookup_spec(spec):
            if tree is not None:
                raise ValueError(
                    f"{spec!r} takes its shape from its spec (e.g. ngram:depth=5,branches=2), "
                    "not a tree config: give None at its place in the tree list"
                )
            ssms.append(_lookup_drafter(spec, chains, target.config.vocab_size, target_path))
            continue
        grows = sized and tree is None and not chains
        if spec == "default":
            spec = default_ssm_path(target_path)
            tree = tree or (None if grows else DEFAULT_SSM_TREE)
        feature = spec == "feature" or (isinstance(spec, str) and spec.startswith("feature:"))
        if spec == "feature":
            spec = default_feature_path(target_path)
        elif feature:
            spec = spec.removeprefix("feature:")
        if grows:
            tree = SIZED_TREE
        tree = TreeConfig.parse(tree) if isinstance(tree, str) else tree or TreeConfig()
        if chains:
            tree = TreeConfig((1,) * tree.depth, tree.max_nodes, tree.sample_children)
        ssm = load_speculator(spec, target, target_path, tree, dtype, device, feature)
        ssm.sized = grows
        ssm.restrict_head(head_token_ids(spec, head, target.config.vocab_size))
        if int8 and not ssm.shares_target:
            ssm.quantize_int8()
        if torch.device(device).type == "cpu" and not ssm.shares_target:  # else packed with it
            pack_linears(ssm.model)
        ssms.append(ssm)
    return Drafter(ssms)


def selected_layers(specs) -> int:
    """The most target layers a layer-selected SSM among `specs` uses (0: none)."""
    specs = specs if isinstance(specs, list | tuple) else [specs]
    counts = [s if isinstance(s, int) else parse_layers(s)
              for s in specs if isinstance(s, int) or str(s).startswith("layers:")]  # fmt: skip
    return max(counts, default=0)


def head_token_ids(spec, n: int | None, vocab_size: int) -> list[int] | None:
    """The restricted LM head of an SSM, None for the full one.

    An SSM directory with head_tokens.json ({"tokens": ids by descending frequency}) gives its
    first n tokens (n defaults to DEFAULT_HEAD; 0 means the full head). Without the file, n means
    the first n token ids: byte-level BPE vocabularies number tokens roughly in merge order, i.e.
    by frequency, so that is a fair guess for a layer-selected SSM; None or 0 mean the full head.
    """
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"ssm_head must be an integer >= 0 (0 = the full head), got {n!r}")
    if n == 0:
        return None
    file = Path(spec) / "head_tokens.json" if isinstance(spec, str | Path) else None
    if file is not None and file.is_file():
        return _read_head_tokens(file, vocab_size)[: n or DEFAULT_HEAD]
    if n is None or n >= vocab_size:
        return None
    return list(range(n))


def _read_head_tokens(file: Path, vocab_size: int) -> list[int]:
    try:
        tokens = json.loads(file.read_text())["tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f'{file}: expected {{"tokens": [token ids]}} ({e})') from None
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{file}: 'tokens' must be a non-empty list of token ids")
    bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{file}: token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{file}: token ids repeat")
    return tokens


def is_lookup_spec(spec) -> bool:
    """A drafter without a model (prompt lookup, earlier requests' continuations): its spec
    gives its shape, it takes no tree config."""
    return isinstance(spec, str) and spec.partition(":")[0] in ("ngram", "suffix")


def _lookup_drafter(spec: str, chains: bool, vocab_size: int,
                    target_path: Path) -> NgramDrafter | SuffixDrafter:  # fmt: skip
    """Sequence mode (`chains`) takes one branch of each. A suffix drafter's corpus "default" is
    the one shipped for the default model."""
    if spec.partition(":")[0] == "suffix":
        config = SuffixConfig.parse(spec)
        if config.corpus == "default":
            config = replace(config, corpus=str(default_corpus_path(target_path)))
        return SuffixDrafter(config, vocab_size, name=spec, chains=chains)
    config = NgramConfig.parse(spec)
    return NgramDrafter(replace(config, branches=1) if chains else config, name=spec)
