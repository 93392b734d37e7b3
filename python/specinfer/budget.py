"""How much of the drafted trees is worth verifying: a cost-aware cut, learned while serving.

A node is worth its place in the target's tree forward when it raises the expected tokens per
second of the step. Its value is the chance that its whole path gets accepted: the product, down
the path, of each node's conditional acceptance rate (its parent accepted), estimated per drafter
and depth from the verifications so far. The step's cost is the target forward's time for the
batch at a given tree width (measured, per width) plus what the step spends besides (drafting,
verification, commit). `choose` keeps, per request, the most valuable nodes, as many as the
width that maximises expected tokens / step time.

When a batch may be cut is decided here too (`choose`). Lossless: the cut depends on depths and
drafters, never on a sampled token, and it only applies to trees of point-mass proposals (greedy,
top-k children, prompt lookup): those may be dropped for any reason. A tree with a sampled child
is verified whole, since dropping some of a node's i.i.d. draws depending on what they drew would
bias verification. And a batch with a seeded sampling request is verified whole: a seed must
reproduce its output, so its trees must not depend on timings.
"""

from __future__ import annotations

from itertools import accumulate

from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

PRIOR = 2.0  # pseudo-counts pulling a depth's rate towards the depth above (or 0.5 at depth 1)
DECAY = 0.98  # weight of the past per observed step: rates follow the text being generated
SMOOTH = 0.25  # weight of the newest timing of a width


class TreeBudget:
    def __init__(self):
        self.tested: dict[tuple[int, int], float] = {}  # (drafter, depth) -> parent accepted
        self.accepted: dict[tuple[int, int], float] = {}  # ... and the node too
        self.cost: dict[tuple[int, int], float] = {}  # (batch, width) -> target forward s
        self._seen: set[tuple[int, int]] = set()  # widths timed once (that run recorded a graph)
        self.overhead = 0.0  # seconds a step spends outside the target forward

    def rates(self, drafter: int, depth: int) -> list[float]:
        """Conditional acceptance of a node proposed by `drafter` at depths 1..depth (index 0:
        depth 1). A depth seldom tested leans on the depth above it."""
        out, above = [], 0.5
        for d in range(1, depth + 1):
            key = (drafter, d)
            above = (self.accepted.get(key, 0.0) + PRIOR * above) / (
                self.tested.get(key, 0.0) + PRIOR
            )
            out.append(above)
        return out

    def values(self, tree: TokenTree) -> list[float]:
        """Each node's chance of being accepted (the root: 1)."""
        sources = [set() for _ in tree.tokens]
        for child, source in zip(tree.prop_child, tree.prop_source):
            sources[child].add(source)
        depth = max(tree.depths)
        rates = {s: self.rates(s, depth) for s in set(tree.prop_source)}
        value = [1.0]
        for n in range(1, len(tree)):  # parents come before children
            best = max(rates[s][tree.depths[n] - 1] for s in sources[n])
            value.append(value[tree.parents[n]] * best)
        return value

    def choose(self, trees: list[TokenTree], params: list[SamplingParams]) -> list[list[int]]:
        """Per tree (params: its request's), the node ids to keep (root included, parents before
        children)."""
        whole = [list(range(len(t))) for t in trees]
        sampled = any(q >= 0 for t in trees for q in t.prop_q)
        if sampled or any(p.seed is not None and not p.greedy for p in params):
            return whole
        widest = max(len(t) for t in trees)
        orders, gains = [], [float(len(trees))] * widest  # gains[w - 1]: expected tokens at w
        for tree in trees:
            value = self.values(tree)
            # Ties keep the smaller id, so a kept node's parent is always kept.
            order = sorted(range(1, len(tree)), key=lambda n: (-value[n], n))
            orders.append(order)
            top = list(accumulate((value[n] for n in order), initial=0.0))  # top[k]: best k nodes
            for width in range(1, widest + 1):
                gains[width - 1] += top[min(width - 1, len(order))]
        best, best_score = widest, -1.0
        for width in range(1, widest + 1):
            seconds = self.overhead + self.estimate(len(trees), width)
            if seconds <= 0:
                return whole  # nothing timed yet: verify everything and learn
            if gains[width - 1] / seconds > best_score:
                best, best_score = width, gains[width - 1] / seconds
        return [sorted([0] + order[: best - 1]) for order in orders]

    def estimate(self, batch: int, width: int) -> float:
        """The target forward's time at this width: measured, else a lower bound, which makes
        an untried width look attractive until it has been tried: a forward costs at least what
        a narrower one costs, and, per row, at least what a wider one costs per row."""
        if (batch, width) in self.cost:
            return self.cost[batch, width]
        below = [c for (b, w), c in self.cost.items() if b == batch and w < width]
        above = [c * width / w for (b, w), c in self.cost.items() if b == batch and w > width]
        return max(below + above, default=0.0)

    def observe(self, trees: list[TokenTree], paths: list[list[int]]) -> None:
        """Learn from a verification: every node whose parent was accepted was tested."""
        for key in self.tested:
            self.tested[key] *= DECAY
            self.accepted[key] *= DECAY
        for tree, path in zip(trees, paths):
            on_path = set(path)
            for child, source in set(zip(tree.prop_child, tree.prop_source)):
                if tree.parents[child] in on_path:
                    key = (source, tree.depths[child])
                    self.tested[key] = self.tested.get(key, 0.0) + 1
                    self.accepted[key] = self.accepted.get(key, 0.0) + (child in on_path)

    def time_step(self, batch: int, width: int, target_s: float, other_s: float) -> None:
        """Record a step's timings. A width's first forward records its graph, so it is not
        counted."""
        key = (batch, width)
        self.overhead = (
            (1 - SMOOTH) * self.overhead + SMOOTH * other_s if self.overhead else other_s
        )
        if key not in self._seen:
            self._seen.add(key)
            return
        old = self.cost.get(key)
        if old is None:
            self.cost[key] = target_s
        else:  # a stall (another process, the OS) must not price a width out for good
            self.cost[key] = (1 - SMOOTH) * old + SMOOTH * min(target_s, 2 * old)
