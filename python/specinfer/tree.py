"""Token trees: what the speculator proposes and the target verifies in one forward pass.

Node 0 is the root: the newest token of the request, whose K/V the verification step computes.
Nodes are numbered so parents come before children (level by level as they are built), which is
what the depth-first KV commit relies on. Each node's token sequence is the path from the root.

A node's children come from *proposals*: one per draw. A sampled child records the row of the
distribution it was drawn from (`q_rows`); a deterministic top-k child is a point mass (-1). Two
draws of the same token are one node but two proposals: the verifier must see both.

Several SSMs' trees merge into one (`merge_trees`, the paper's Definition 3.2): every token
sequence of every tree appears once, and each proposal keeps its SSM (`prop_source`) and the
distribution that SSM drew it from, so the verifier tests each draw against its own distribution.
A proposal may also carry its drafter's confidence in it (`prop_conf`: the drafter's probability
of the token after its parent, -1 when it has none), which the cost-aware cut prices nodes by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeConfig:
    """Expansion config <k1, ..., km>: every node at depth i gets the top-k_{i+1} (or k_{i+1}
    sampled) children. `sample_children` applies to stochastic decoding only: draw children
    i.i.d. from the SSM (the paper's stochastic setting) instead of taking its top-k.
    `beam`: of each level, only the `beam` nodes the SSM finds likeliest (the product of its
    probabilities down the path) get children, as EAGLE-2's dynamic trees: a tree can then be
    wide where the SSM is unsure and deep where it is sure, at `beam` SSM rows a level. Top-k
    children only (a sampled child's draws are verified whole, whatever they drew)."""

    widths: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
    max_nodes: int = 64
    sample_children: bool = False
    beam: int | None = None

    def __post_init__(self):
        widths = tuple(self.widths)
        object.__setattr__(self, "widths", widths)
        if not widths:
            raise ValueError("tree widths must not be empty (e.g. (1, 1, 3, 1))")
        if any(not isinstance(k, int) or k < 1 for k in widths):
            raise ValueError(f"tree widths must be positive integers, got {widths}")
        if self.beam is not None and (not isinstance(self.beam, int) or self.beam < 1):
            raise ValueError(f"tree beam must be a positive integer or None, got {self.beam!r}")
        if self.beam is not None and self.sample_children:
            raise ValueError("a tree with a beam takes top-k children: sample_children must be "
                             "False")  # fmt: skip
        if self.num_nodes > self.max_nodes:
            raise ValueError(
                f"tree {widths} has {self.num_nodes} nodes, more than max_nodes={self.max_nodes}; "
                "use fewer/narrower levels or raise max_nodes (verification cost grows with it)"
            )

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def num_nodes(self) -> int:
        """Nodes of the full tree, root included (sampled trees can be smaller: duplicates merge)."""
        return sum(self.level_sizes) + 1

    @property
    def level_sizes(self) -> list[int]:
        """Nodes at depth 1, 2, ... of the full tree."""
        sizes, level = [], 1
        for k in self.widths:
            level = min(level, self.beam or level) * k
            sizes.append(level)
        return sizes

    @classmethod
    def parse(cls, text: str, **kwargs) -> TreeConfig:
        """'1,1,3,1' -> TreeConfig(widths=(1, 1, 3, 1))."""
        try:
            widths = tuple(int(x) for x in text.replace(" ", "").split(","))
        except ValueError:
            raise ValueError(
                f"tree config must be comma-separated integers like 1,1,3,1, got {text!r}"
            ) from None
        return cls(widths=widths, **kwargs)


class TokenTree:
    def __init__(self, root_token: int):
        self.tokens = [root_token]
        self.parents = [-1]
        self.depths = [0]
        self.children: list[dict[int, int]] = [{}]  # token -> node
        self.prop_parent: list[int] = []
        self.prop_child: list[int] = []
        self.prop_q: list[int] = []
        self.prop_source: list[int] = []  # which SSM made each proposal (index in a merge)
        self.prop_conf: list[float] = []  # the drafter's probability of it (-1: none given)
        self.q_rows: list[torch.Tensor] = []  # distributions sampled children were drawn from

    def __len__(self) -> int:
        return len(self.tokens)

    def propose(self, parent: int, token: int, q_row: int = -1, source: int = 0,
                conf: float = -1.0) -> int:  # fmt: skip
        """Record one proposal of `token` under `parent`; returns the (possibly existing) node."""
        node = self.children[parent].get(token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.children.append({})
            self.children[parent][token] = node
        self.prop_parent.append(parent)
        self.prop_child.append(node)
        self.prop_q.append(q_row)
        self.prop_source.append(source)
        self.prop_conf.append(conf)
        return node

    def propose_once(self, parent: int, token: int, conf: float = -1.0) -> int:
        """A point-mass proposal of `token` unless `parent` already has that child (a second
        point mass at the same token could never be accepted: the first rejection zeroes it)."""
        node = self.children[parent].get(token)
        return self.propose(parent, token, conf=conf) if node is None else node

    def add_distribution(self, q: torch.Tensor) -> int:
        self.q_rows.append(q)
        return len(self.q_rows) - 1

    def sources(self, node: int) -> set[int]:
        """The SSMs that proposed `node` (the root: none)."""
        return {s for c, s in zip(self.prop_child, self.prop_source) if c == node}

    def nodes_at(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def ancestor_mask(
        self, nodes: list[int] | None = None, columns: list[int] | None = None
    ) -> torch.Tensor:
        """mask[i, j] = columns[j] is an ancestor of nodes[i] or the node itself (default: all)."""
        nodes = list(range(len(self))) if nodes is None else nodes
        columns = list(range(len(self))) if columns is None else columns
        col_index = {c: j for j, c in enumerate(columns)}
        at_rows, at_columns = [], []  # set in one indexing op (one per element: ~0.1 ms a step)
        for i, node in enumerate(nodes):
            while node >= 0:
                j = col_index.get(node)
                if j is not None:
                    at_rows.append(i)
                    at_columns.append(j)
                node = self.parents[node]
        mask = torch.zeros(len(nodes), len(columns), dtype=torch.bool)
        mask[at_rows, at_columns] = True
        return mask

    def branches(self, nodes: list[int] | None = None) -> list[list[int]]:
        """Per node (default: all), the tokens of its path below the root, itself included: what
        the request would hold after it, past its committed tokens."""
        below = [[]]
        for n in range(1, len(self)):  # parents come before children
            below.append(below[self.parents[n]] + [self.tokens[n]])
        return below if nodes is None else [below[n] for n in nodes]

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[n] for n in path]

    def subtree(self, keep: list[int]) -> tuple[TokenTree, list[int]]:
        """The tree of the nodes in `keep` (ascending, the root and every kept node's parent
        among them) with all their proposals; returns it and each node's new id (-1: dropped)."""
        new_id = [-1] * len(self)
        for i, n in enumerate(keep):
            new_id[n] = i
        if new_id[0] != 0 or any(new_id[self.parents[n]] < 0 for n in keep[1:]):
            raise ValueError("subtree: the kept nodes must include the root and their parents")
        tree = TokenTree(self.tokens[0])
        tree.q_rows = list(self.q_rows)
        # In order of the new child ids: nodes get the same relative numbering.
        kept = sorted((new_id[c], p) for p, c in enumerate(self.prop_child) if new_id[c] > 0)
        for _, p in kept:
            token = self.tokens[self.prop_child[p]]
            tree.propose(new_id[self.prop_parent[p]], token, self.prop_q[p], self.prop_source[p],
                         self.prop_conf[p])  # fmt: skip
        return tree, new_id


def merge_trees(trees: list[TokenTree]) -> tuple[TokenTree, list[list[int]]]:
    """Merge trees with the same root (one per SSM) into one: every token sequence of every tree
    is one node of the result, numbered level by level (parents before children). Every proposal
    is kept, duplicates across SSMs included (each is a separate draw), with its SSM as source
    and its distribution appended to the merged q_rows. Returns the merged tree and, per input
    tree, the merged node id of each of its nodes."""
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError(
            f"trees to merge must share the root token, got {[t.tokens[0] for t in trees]}"
        )
    merged = TokenTree(root)
    maps = [[0] * len(t) for t in trees]
    q_offsets = []
    for tree in trees:
        q_offsets.append(len(merged.q_rows))
        merged.q_rows.extend(tree.q_rows)
    by_depth: dict[int, list[tuple[int, int]]] = {}  # depth -> (tree, proposal)
    for i, tree in enumerate(trees):
        for p, child in enumerate(tree.prop_child):
            by_depth.setdefault(tree.depths[child], []).append((i, p))
    for depth in sorted(by_depth):
        for i, p in by_depth[depth]:
            tree = trees[i]
            q = tree.prop_q[p]
            child = tree.prop_child[p]
            maps[i][child] = merged.propose(
                maps[i][tree.prop_parent[p]],
                tree.tokens[child],
                q + q_offsets[i] if q >= 0 else -1,
                i,
                tree.prop_conf[p],
            )
    return merged, maps
