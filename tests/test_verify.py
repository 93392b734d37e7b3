"""Verifiers (specinfer.verify): greedy on hand-built trees, and multi-step speculative sampling held
to the target's distribution by chi-squared tests over many seeds, for the compiled verifier and
its pure-Python reference alike."""

from __future__ import annotations

import random
import zlib
from collections import Counter
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer import verify

_C = pytest.importorskip("specinfer._C")

# --- greedy ---

#        0 (9)
#   /      |      \
# 1 (3)  2 (5)   3 (5)      <- two children with token 5: node order picks 2
#        /   \      |
#     4 (4) 5 (7)  6 (4)
PARENTS = [-1, 0, 0, 0, 2, 2, 3]
TOKENS = [9, 3, 5, 5, 4, 7, 4]


@pytest.mark.parametrize(
    "argmax,expected",
    [
        ([5, 0, 4, 4, 8, 0, 0], ([0, 2, 4], 8)),  # two accepted, bonus from node 4
        ([5, 0, 7, 0, 0, 1, 0], ([0, 2, 5], 1)),
        ([3, 6, 0, 0, 0, 0, 0], ([0, 1], 6)),  # node 1 is a leaf
        ([5, 0, 9, 0, 0, 0, 0], ([0, 2], 9)),  # correction at node 2
        ([8, 0, 0, 0, 0, 0, 0], ([0], 8)),  # nothing accepted
    ],
)
def test_verify_greedy(argmax, expected):
    for fn in (verify.verify_greedy, verify.verify_greedy_reference):
        assert fn(PARENTS, TOKENS, argmax) == expected
    assert verify.verify_greedy(torch.tensor(PARENTS).int(), torch.tensor(TOKENS), argmax) == (
        expected
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data(), nodes=st.integers(1, 30), vocab=st.integers(1, 4))
def test_verify_greedy_matches_reference(data, nodes, vocab):
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, nodes)]
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=nodes, max_size=nodes))
    argmax = data.draw(st.lists(st.integers(0, vocab - 1), min_size=nodes, max_size=nodes))
    path, token = verify.verify_greedy(parents, tokens, argmax)
    assert (path, token) == verify.verify_greedy_reference(parents, tokens, argmax)
    assert all(parents[c] == p and tokens[c] == argmax[p] for p, c in zip(path, path[1:]))
    assert token == argmax[path[-1]]


# --- a small target and two SSMs over a 6-token vocabulary ---

V = 6
ROOT = 0  # the request's last committed token
SAMPLES = 20_000
P_CRITICAL = 1e-3


@cache
def distribution(context: tuple[int, ...], model: int) -> tuple[float, ...]:
    """model 0 is the target: one token per context has probability 0, the SSM's never do.
    Models 1 and 2 are SSMs: the target blended with their own noise."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((context, model)).encode()))
    probs = torch.softmax(1.5 * torch.randn(V, generator=gen, dtype=torch.float64), 0)
    if model == 0:
        probs[int(torch.randint(V, (1,), generator=gen))] = 0.0
    else:
        probs = 0.5 * torch.tensor(distribution(context, 0), dtype=torch.float64) + 0.5 * probs
    return tuple((probs / probs.sum()).tolist())


class Tree:
    """A token tree as the speculator builds it: duplicate tokens under one parent are one node
    with one proposal per draw; sampled proposals record the q row they were drawn from."""

    def __init__(self, context: tuple[int, ...]):
        self.parents, self.tokens, self.contexts = [-1], [context[-1]], [context]
        self.proposals: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.q_rows: list[tuple[float, ...]] = []
        self.q_row_of: dict[tuple[int, int], int] = {}

    def q_row(self, node: int, model: int) -> int:
        if (node, model) not in self.q_row_of:
            self.q_row_of[node, model] = len(self.q_rows)
            self.q_rows.append(distribution(self.contexts[node], model))
        return self.q_row_of[node, model]

    def propose(self, parent: int, token: int, q_row: int) -> None:
        child = next(
            (c for c, p in enumerate(self.parents) if p == parent and self.tokens[c] == token),
            None,
        )
        if child is None:
            child = len(self.tokens)
            self.parents.append(parent)
            self.tokens.append(token)
            self.contexts.append(self.contexts[parent] + (token,))
        for column, value in zip(self.proposals, (parent, child, q_row)):
            column.append(value)

    def p_target(self) -> torch.Tensor:
        return torch.tensor([distribution(c, 0) for c in self.contexts], dtype=torch.float32)

    def q(self) -> torch.Tensor | None:
        return torch.tensor(self.q_rows, dtype=torch.float32) if self.q_rows else None


# A scenario lists, per depth, how each node's children are proposed: (kind, SSM, count), with
# kind "sample" (count i.i.d. draws) or "topk" (the SSM's count most likely tokens).
SCENARIOS = {
    "sampled": [[("sample", 1, 3)], [("sample", 1, 2)]],
    "topk": [[("topk", 1, 2)], [("topk", 1, 2)]],
    "merged": [[("sample", 1, 2), ("sample", 2, 1)], [("sample", 1, 1), ("sample", 2, 1)]],
    "mixed": [[("topk", 1, 2), ("sample", 2, 1)], [("sample", 2, 2)]],
}


def build(scenario: list, context: tuple[int, ...], rng: random.Random) -> Tree:
    tree, level = Tree(context), [0]
    for proposers in scenario:
        first_new = len(tree.tokens)
        for node in level:
            for kind, model, count in proposers:
                q = distribution(tree.contexts[node], model)
                if kind == "sample":
                    row = tree.q_row(node, model)
                    for token in rng.choices(range(V), weights=q, k=count):
                        tree.propose(node, token, row)
                else:
                    for token in sorted(range(V), key=lambda t: -q[t])[:count]:
                        tree.propose(node, token, -1)
        level = list(range(first_new, len(tree.tokens)))
    return tree


def stochastic(fn):
    return lambda tree, seed: fn(
        tree.parents, tree.tokens, tree.p_target(), tree.proposals, tree.q(), seed
    )


def naive(fn):
    return lambda tree, seed: fn(tree.parents, tree.tokens, tree.p_target(), seed)


VERIFIERS = {
    "compiled": stochastic(verify.verify_stochastic),
    "reference": stochastic(verify.verify_stochastic_reference),
}


def first_two_tokens(scenario: list, verifier, seed: int) -> tuple[tuple[int, int], int]:
    """Decodes from the root until two tokens are out; also returns the first step's accepted
    node count."""
    rng = random.Random(seed)
    context, out, accepted = (ROOT,), [], None
    while len(out) < 2:
        tree = build(scenario, context, rng)
        path, token = verifier(tree, rng.getrandbits(64))
        assert all(tree.parents[c] == p for p, c in zip(path, path[1:]))
        accepted = len(path) - 1 if accepted is None else accepted
        new = [tree.tokens[n] for n in path[1:]] + [token]
        out += new
        context += tuple(new)
    return (out[0], out[1]), accepted


def chi_squared(counts: Counter, expected: dict) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value; a cell of probability 0 must be empty."""
    n = sum(counts.values())
    assert all(expected.get(cell, 0.0) > 0 for cell in counts), "an impossible outcome occurred"
    cells = [cell for cell, p in expected.items() if p > 0]
    stat = sum((counts[c] - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    df = len(cells) - 1
    half = torch.tensor([df, stat], dtype=torch.float64) / 2
    p_value = torch.special.gammaincc(half[0], half[1]).item()
    return stat, df, p_value


def target_first_two() -> tuple[dict, dict]:
    first = dict(enumerate(distribution((ROOT,), 0)))
    pairs = {(a, b): first[a] * distribution((ROOT, a), 0)[b] for a in range(V) for b in range(V)}
    return first, pairs


def run_chi_squared(scenario: str, verifier, samples: int = SAMPLES, seed: int = 0):
    """(first-token test, first-two-tokens test, mean first-step accepted nodes)."""
    rng = random.Random(seed)
    runs = [
        first_two_tokens(SCENARIOS[scenario], verifier, rng.getrandbits(64)) for _ in range(samples)
    ]
    first, pairs = target_first_two()
    pair_counts = Counter(p for p, _ in runs)
    first_counts = Counter(p[0] for p, _ in runs)
    accepted = sum(a for _, a in runs) / samples
    return chi_squared(first_counts, first), chi_squared(pair_counts, pairs), accepted


@pytest.mark.parametrize("implementation", VERIFIERS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_verify_stochastic_is_lossless(scenario, implementation):
    first, pairs, accepted = run_chi_squared(scenario, VERIFIERS[implementation])
    assert first[2] > P_CRITICAL, f"first token: chi2={first[0]:.1f} df={first[1]} p={first[2]}"
    assert pairs[2] > P_CRITICAL, f"first two: chi2={pairs[0]:.1f} df={pairs[1]} p={pairs[2]}"
    assert accepted > 0.5  # the SSMs resemble the target: speculation must pay


@pytest.mark.parametrize("implementation", [verify.verify_naive, verify.verify_naive_reference])
def test_verify_naive_is_lossless_but_accepts_less(implementation):
    """Naive sampling draws every token from the target, so it passes the same test; multi-step
    speculative sampling accepts more sampled children (SpecInfer, Theorem 4.3)."""
    first, pairs, accepted = run_chi_squared("sampled", naive(implementation))
    assert first[2] > P_CRITICAL and pairs[2] > P_CRITICAL, (first, pairs)
    *_, accepted_mss = run_chi_squared("sampled", VERIFIERS["compiled"], samples=5000)
    assert accepted_mss > accepted + 0.1, (accepted_mss, accepted)


def q_ratio_on_topk(tree: Tree, seed: int):
    """Wrong: top-k children tested as if drawn from the SSM's distribution (min(1, p/q) and
    residual max(0, r - q)) although they were chosen deterministically."""
    parents, children, rows = tree.proposals
    as_drawn = [tree.q_row(parent, 1) if row < 0 else row for parent, row in zip(parents, rows)]
    return verify.verify_stochastic(
        tree.parents, tree.tokens, tree.p_target(), (parents, children, as_drawn), tree.q(), seed
    )


def duplicates_collapsed(tree: Tree, seed: int):
    """Wrong: a token drawn twice tested once (proposal multiplicity lost)."""
    unique = sorted(set(zip(*tree.proposals)), key=lambda p: (p[0], p[1]))
    proposals = tuple(list(column) for column in zip(*unique))
    return verify.verify_stochastic(
        tree.parents, tree.tokens, tree.p_target(), proposals, tree.q(), seed
    )


@pytest.mark.parametrize(
    "scenario,verifier", [("topk", q_ratio_on_topk), ("sampled", duplicates_collapsed)]
)
def test_chi_squared_catches_wrong_verifiers(scenario, verifier):
    """The test has power: plausible mistakes fail it."""
    first, pairs, _ = run_chi_squared(scenario, verifier)
    assert min(first[2], pairs[2]) < P_CRITICAL, (first, pairs)


# --- edge cases and errors ---

ALL_STOCHASTIC = [verify.verify_stochastic, verify.verify_stochastic_reference]


@pytest.mark.parametrize("fn", ALL_STOCHASTIC)
def test_verify_stochastic_certain_outcomes(fn):
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.7, 0.0, 0.3]])
    chain = ([-1, 0, 1], [3, 2, 1])
    bonus = Counter()
    for seed in range(400):
        # q equal to the target: the sampled child is always accepted; so is a point mass at a
        # token of probability 1; the bonus comes from the leaf's distribution (tokens 1 and 3,
        # 7:3), not from the root's or the middle node's.
        path, token = fn(*chain, p, ([0, 1], [1, 2], [0, -1]), p[:1], seed)
        assert path == [0, 1, 2]
        bonus[token] += 1
    assert set(bonus) == {1, 3}, bonus  # 0 and 2 have probability 0 at the leaf
    assert abs(bonus[1] / 400 - 0.7) < 0.1, bonus  # 4.4 standard deviations
    for seed in range(50):
        # A child of target probability 0 is never accepted, nor drawn as the correction.
        path, token = fn([-1, 0], [9, 3], p[:2], ([0], [1], [-1]), None, seed)
        assert path == [0] and token != 3
        # A root without children draws from its own distribution.
        assert fn([-1], [7], p[1:2], ([], [], []), None, seed) == ([0], 1)


@pytest.mark.parametrize("fn", [verify.verify_naive, verify.verify_naive_reference])
def test_verify_naive_follows_sampled_tokens(fn):
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert fn([-1, 0, 0, 2], [5, 2, 1, 2], p, 3) == ([0, 2, 3], 0)


def _stochastic_args():
    p = torch.full((3, 4), 0.25)
    return [[-1, 0, 0], [5, 1, 2], p, ([0, 0], [1, 2], [0, -1]), torch.full((1, 4), 0.25), 0]


def _with(i, value):
    def change(args):
        args[i] = value

    return change


@pytest.mark.parametrize(
    "change,message",
    [
        (_with(0, []), r"parents is empty"),
        (_with(0, [0, 0, 0]), r"parents\[0\] = 0 must be -1 \(node 0 is the root\)"),
        (_with(0, [-1, 2, 0]), r"parents\[1\] = 2 must be in \[0, 1\) \(parents come before"),
        (_with(1, [5, 1]), r"tokens.shape\[0\] must be 3 \(nodes in parents\), got 2"),
        (_with(1, [5, 1, 4]), r"tokens\[2\] = 4 is out of range \[0, 4\)"),
        (_with(2, torch.full((2, 4), 0.25)), r"p_target.shape\[0\] must be 3"),
        (_with(2, torch.full((3, 4, 1), 0.25)), r"p_target must have 2 dims \[rows, vocab\]"),
        (
            _with(2, torch.tensor([[0.5, -0.1, 0.3, 0.3]] * 3)),
            r"p_target\[0\]\[1\] = -0.1\d* is not a probability",
        ),
        (
            _with(2, torch.tensor([[0.5, float("nan"), 0.3, 0.3]] * 3)),
            r"p_target\[0\]\[1\] = nan is not a probability",
        ),
        (_with(2, torch.zeros(3, 4)), r"p_target\[0\] sums to 0"),
        (
            _with(3, ([0, 0], [1, 2], [0])),
            r"prop_q.shape\[0\] must be 2 \(proposals in prop_parent\)",
        ),
        (
            _with(3, ([0, 0], [1, 3], [0, -1])),
            r"prop_child\[1\] = 3 must be a non-root node in \[1, 3\)",
        ),
        (_with(3, ([0, 1], [1, 2], [0, -1])), r"prop_parent\[1\] = 1 but node 2's parent is 0"),
        (
            _with(3, ([0, 0], [1, 2], [0, 1])),
            r"prop_q\[1\] = 1 must be -1 \(a deterministic proposal\) or a row of q in \[0, 1\)",
        ),
        (_with(3, ([0], [1], [-1])), r"node 2 has no proposal"),
        (_with(4, None), r"prop_q\[0\] = 0 must be -1 .* \(q is None\)"),
        (_with(4, torch.full((1, 5), 0.2)), r"q.shape\[1\] must be 4 \(vocab of p_target\)"),
        (
            _with(4, torch.tensor([[0.5, 0.0, 0.5, 0.0]])),
            r"q\[0\]\[1\] = 0, but proposal 0 drew token 1 from it",
        ),
    ],
)
def test_verify_stochastic_errors(change, message):
    args = _stochastic_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        verify.verify_stochastic(*args)


def test_verify_errors_greedy_naive_and_types():
    with pytest.raises(ValueError, match=r"target_argmax.shape\[0\] must be 3"):
        verify.verify_greedy([-1, 0, 0], [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match=r"target_argmax\[0\] = -1 is negative"):
        verify.verify_greedy([-1, 0, 0], [1, 2, 3], [-1, 2, 2])
    with pytest.raises(ValueError, match=r"p_target must be float32, got float16"):
        _C.verify_naive(torch.tensor([-1]), torch.tensor([0]), torch.ones(1, 3).half(), 0)
    with pytest.raises(ValueError, match=r"parents must be int32 or int64, got float32"):
        _C.verify_greedy(torch.tensor([-1.0]), torch.tensor([0]), torch.tensor([0]))
