"""Token-tree verifiers: which speculated nodes the target accepts, and the token it adds.

The tree, shared by all: nodes 0..T-1 numbered so parents come before children, node 0 the root
(the request's last committed token, whose K/V the verification step computes); `parents[T]`
(parents[0] = -1) and `tokens[T]`. Each verifier returns (path, next_token): the accepted nodes
starting with 0, and the target's token after the last of them (the correction, or the bonus when
the walk ran off the tree). The request gains tokens[path[1:]] and then next_token.

Each verifier has a pure-Python reference (the semantics; tests hold both to the same statistical
tests) and a wrapper over the compiled core. Stochastic ones take a seed: the engine draws it from
the request's generator, so a request's output is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

try:
    from specinfer import _C
except ImportError:  # pragma: no cover - only when the extension was not built
    _C = None

Ints = Sequence[int] | torch.Tensor
# (prop_parent, prop_child, prop_q): proposal i drew child prop_child[i] of node prop_parent[i]
# from row prop_q[i] of q, or deterministically (a point mass, e.g. top-k) when prop_q[i] = -1.
# A child drawn twice (two i.i.d. draws of one token) is one node with two proposals.
Proposals = tuple[Ints, Ints, Ints]


def _ints(x: Ints) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _children(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    return children


def _normalised(row: torch.Tensor) -> list[float]:
    values = row.tolist()
    total = sum(values)
    return [v / total for v in values]


def _sample(r: list[float], rng: random.Random) -> int:
    target = rng.random() * sum(r)
    cumulative, last = 0.0, -1
    for token, p in enumerate(r):
        if p > 0:
            last = token
            cumulative += p
            if target < cumulative:
                return token
    return last  # rounding left the target at the very end


def _adopt_residual(residual: list[float], r: list[float]) -> list[float]:
    """norm(residual), or r when the residual has no mass: the rejection that led here had
    probability equal to that mass, so it happened only through rounding (r equals the proposal
    distribution up to it) and r is the closest valid distribution."""
    total = sum(residual)
    return [v / total for v in residual] if total > 0 else r


def verify_greedy_reference(
    parents: Ints, tokens: Ints, target_argmax: Ints
) -> tuple[list[int], int]:
    """From the root, move to the first child (in node order) whose token is the target's argmax
    at the current node; next_token is the argmax at the last node of the path."""
    parents, tokens, argmax = _ints(parents), _ints(tokens), _ints(target_argmax)
    children = _children(parents)
    path = [0]
    while True:
        want = argmax[path[-1]]
        child = next((c for c in children[path[-1]] if tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)


def verify_stochastic_reference(
    parents: Ints,
    tokens: Ints,
    p_target: torch.Tensor,
    proposals: Proposals,
    q: torch.Tensor | None,
    seed: int,
) -> tuple[list[int], int]:
    """Multi-step speculative sampling (SpecInfer, Algorithm 2), lossless: the emitted tokens
    follow the target's distribution p_target[u] (already temperature/top-k/top-p adjusted) at
    every node u. At u, r = p_target[u]; u's proposals are tested in uniformly random order:

    - drawn from d = q[row]: accept with probability min(1, r[x] / d[x]); on rejection
      r = norm(max(0, r - d));
    - deterministic (a point mass at x): accept with probability r[x]; on rejection r[x] = 0 and
      r is renormalised.

    An accepted proposal moves the walk to its child. When all of u's proposals are rejected (or
    u has none), next_token ~ r. Every proposal counts, duplicates included: two draws of one
    token are two tests.
    """
    rng = random.Random(seed)
    tokens = _ints(tokens)
    prop_parent, prop_child, prop_q = (_ints(x) for x in proposals)
    proposals_of: list[list[int]] = [[] for _ in _ints(parents)]
    for p, u in enumerate(prop_parent):
        proposals_of[u].append(p)
    path = [0]
    while True:
        r = _normalised(p_target[path[-1]])
        order = proposals_of[path[-1]][:]
        rng.shuffle(order)
        for p in order:
            child = prop_child[p]
            x = tokens[child]
            if prop_q[p] < 0:
                accept = rng.random() < r[x]
                residual = r[:]
                residual[x] = 0.0
            else:
                d = _normalised(q[prop_q[p]])
                accept = rng.random() * d[x] < r[x]
                residual = [max(0.0, a - b) for a, b in zip(r, d)]
            if accept:
                path.append(child)
                break
            r = _adopt_residual(residual, r)
        else:
            return path, _sample(r, rng)


def verify_naive_reference(
    parents: Ints, tokens: Ints, p_target: torch.Tensor, seed: int
) -> tuple[list[int], int]:
    """The ablation baseline: at node u draw x ~ p_target[u]; move to the first child with token
    x if there is one, else next_token = x. Every token is drawn from the target, so it is as
    lossless as multi-step speculative sampling, but it accepts fewer sampled children."""
    rng = random.Random(seed)
    tokens = _ints(tokens)
    children = _children(_ints(parents))
    path = [0]
    while True:
        x = _sample(_normalised(p_target[path[-1]]), rng)
        child = next((c for c in children[path[-1]] if tokens[c] == x), None)
        if child is None:
            return path, x
        path.append(child)


def _host_ints(x: Ints) -> torch.Tensor:
    return torch.as_tensor(x).to("cpu", torch.int64)


def _host_probs(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float32).contiguous()


def _seed(seed: int) -> int:
    return seed % 2**64  # the compiled RNG takes 64 bits


def verify_greedy(parents: Ints, tokens: Ints, target_argmax: Ints) -> tuple[list[int], int]:
    """The compiled verifier, else the reference (same semantics)."""
    if _C is None:
        return verify_greedy_reference(parents, tokens, target_argmax)
    return _C.verify_greedy(_host_ints(parents), _host_ints(tokens), _host_ints(target_argmax))


def verify_stochastic(
    parents: Ints,
    tokens: Ints,
    p_target: torch.Tensor,
    proposals: Proposals,
    q: torch.Tensor | None,
    seed: int,
) -> tuple[list[int], int]:
    """The compiled verifier, else the reference (same semantics, different random stream)."""
    if _C is None:
        return verify_stochastic_reference(parents, tokens, p_target, proposals, q, seed)
    return _C.verify_stochastic(
        _host_ints(parents),
        _host_ints(tokens),
        _host_probs(p_target),
        *(_host_ints(x) for x in proposals),
        None if q is None else _host_probs(q),
        _seed(seed),
    )


def verify_naive(
    parents: Ints, tokens: Ints, p_target: torch.Tensor, seed: int
) -> tuple[list[int], int]:
    """The compiled verifier, else the reference (same semantics, different random stream)."""
    if _C is None:
        return verify_naive_reference(parents, tokens, p_target, seed)
    return _C.verify_naive(
        _host_ints(parents), _host_ints(tokens), _host_probs(p_target), _seed(seed)
    )
