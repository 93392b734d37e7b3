"""One speculative step over every decoding sequence: draft a tree each, cut what does not pay,
verify all trees in one target forward, commit the accepted paths in every cache.

No state is carried from one step to the next here: the SSMs keep theirs per cache row, the
budget its learned rates and costs.
"""

from __future__ import annotations

import time

import torch

from specinfer import verify
from specinfer.budget import SEEDED_DEPTH, must_draft
from specinfer.engine.model_runner import ModelRunner
from specinfer.engine.sequence import Sequence
from specinfer.sampling import (
    TokenLogprob,
    draw_seed,
    greedy_tokens,
    next_token,
    probabilities,
    token_logprobs,
)
from specinfer.tree import TokenTree


def speculative_step(seqs: list[Sequence], kv, runner: ModelRunner, drafter, budget,
                     verifier: str, max_nodes: int | None = None,
                     ) -> tuple[list[list[int]], list[TokenTree], list]:  # fmt: skip
    """Each sequence's new tokens (its accepted path's tokens, then the target's next one), the
    tree that was verified (at most `max_nodes` of each drafted tree: the first ids, which keep
    every node's parent) and the new tokens' logprobs (None where not asked for)."""
    tokens = [s.prompt_ids + s.output_ids for s in seqs]
    # No point speculating past what the request may still generate.
    max_depths = [s.max_len - len(seq) - 1 for s, seq in zip(seqs, tokens)]
    n = len(drafter.ssms)
    run = frozenset(range(n))
    if budget:
        run = budget.drafts(n, len(seqs), drafter.backlog(seqs, tokens))
    depths = [_depths(i, ssm, seqs, max_depths, i in run, budget)
              for i, ssm in enumerate(drafter.ssms)]  # fmt: skip
    t0 = time.perf_counter()
    trees = drafted = drafter.draft(seqs, tokens, depths)
    for i, (ssm, caps) in enumerate(zip(drafter.ssms, depths)):
        if ssm.sized:
            budget.time_levels(i, max(caps), drafter.last_times[i], len(seqs))
    if max_nodes is not None and any(len(t) > max_nodes for t in trees):
        trees = drafter.keep([list(range(min(len(t), max_nodes))) for t in trees])
    if budget and run:
        trees = drafter.keep(budget.choose(trees, [s.params for s in seqs], drafter.last_times))
    t1 = time.perf_counter()
    prefix = [len(seq) - 1 for seq in tokens]
    # Nothing drafted or kept: a plain decode step (the same forward as a root-only tree, no
    # verification or commit). Not with seeded sampling, whose draws must not depend on which
    # path the rest of its batch took.
    plain = all(len(t) == 1 for t in trees) and not any(must_draft(s.params) for s in seqs)
    if plain:
        logits = runner.decode(kv, seqs)
        t2 = time.perf_counter()
        verified = [([0], token) for token in sample_all(seqs, logits)]
    else:
        logits = runner.tree(kv, seqs, trees)
        t2 = time.perf_counter()
        # Greedy rows without penalties: one max over the batch's trees.
        plain_greedy = [_plain_greedy(s) for s in seqs]
        argmax = greedy_tokens(logits) if any(plain_greedy) else None
        verified = [verify_tree(s, tree, logits[b, : len(tree)], verifier,
                                argmax[b, : len(tree)] if plain_greedy[b] else None)
                    for b, (s, tree) in enumerate(zip(seqs, trees))]  # fmt: skip
    paths = [path for path, _ in verified]
    t3 = time.perf_counter()
    if not plain:
        runner.commit_paths(kv, seqs, prefix, paths)
    drafter.commit(seqs, prefix, paths)
    t4 = time.perf_counter()
    if budget:
        budget.observe(drafted, [_drafted_path(d, t, p) for d, t, p in zip(drafted, trees, paths)],
                       [nxt for _, nxt in verified])  # fmt: skip
        budget.time_step(len(seqs), max(len(t) for t in trees), t2 - t1, t4 - t2,
                         t1 - t0 if run else None, runner.graphs.warm)  # fmt: skip
    drafter.record([s.metrics for s in seqs], paths)
    for s, path, tree in zip(seqs, paths, trees):
        m = s.metrics
        m["ssm_s"] += t1 - t0
        m["target_s"] += t2 - t1
        m["verify_s"] += t3 - t2
        m["commit_s"] += t4 - t3
        m["tree_nodes"] += len(tree)
        accepted = m["accepted_per_depth"]
        accepted += [0] * (len(path) - 1 - len(accepted))
        for depth in range(len(path) - 1):
            accepted[depth] += 1
    new = [tree.path_tokens(path[1:]) + [nxt] for tree, (path, nxt) in zip(trees, verified)]
    # A path's node i gave its token i+1 (the root the first): its logits row scores it.
    scores = [logprobs_of(s, logits[b : b + 1] if plain else logits[b, path], tokens)
              for b, (s, path, tokens) in enumerate(zip(seqs, paths, new))]  # fmt: skip
    return new, trees, scores


def _drafted_path(drafted: TokenTree, tree: TokenTree, path: list[int]) -> list[int]:
    """A path of the cut `tree` in the node ids of the tree it was cut from."""
    nodes = [0]
    for n in path[1:]:
        nodes.append(drafted.children[nodes[-1]][tree.tokens[n]])
    return nodes


def _depths(i: int, ssm, seqs: list[Sequence], max_depths: list[int], runs: bool,
            budget) -> list[int]:  # fmt: skip
    """SSM i's depth per request: 0 (no draft) where the budget leaves it out; a seeded
    request is drafted always (a sized SSM's tree: SEEDED_DEPTH levels, whatever the timings);
    a sized SSM drafts as deep as the budget finds it pays (sized SSMs come with a budget)."""
    sized = ssm.sized and runs
    cap = budget.depth(i, ssm.tree.widths, len(seqs), ssm.tree.beam) if sized else None
    out = []
    for s, d in zip(seqs, max_depths):
        if must_draft(s.params):
            out.append(min(d, SEEDED_DEPTH) if ssm.sized else d)
        else:
            out.append(0 if not runs else min(d, cap) if cap else d)
    return out


def logprobs_of(
    seq: Sequence, logits: torch.Tensor, tokens: list[int]
) -> list[TokenLogprob] | None:
    """The request's logprobs of `tokens` (row i of logits [N, V] chose tokens[i]), if it asked."""
    if seq.params.logprobs is None:
        return None
    return token_logprobs(logits, tokens, seq.params.logprobs)


def sample(seq: Sequence, logits: torch.Tensor) -> int:
    """The request's next token from the logits [V] after all its tokens so far."""
    logits = seq.penalties.apply(logits[None], seq.output_ids)[0]
    if seq.grammar is not None:
        logits = seq.grammar.mask(logits)
    return next_token(logits, seq.params, seq.generator)


def sample_all(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Each sequence's next token from its row of logits [B, V]: the greedy ones without
    penalties through one max over their rows (a call per row cost 0.47 ms a step at batch 16),
    the others one by one."""
    greedy = [_plain_greedy(s) for s in seqs]
    plain = [b for b, g in enumerate(greedy) if g]
    tokens = [0] * len(seqs)
    if plain:
        rows = logits if len(plain) == len(seqs) else logits[plain]
        for b, token in zip(plain, greedy_tokens(rows).tolist()):
            tokens[b] = token
    for b, (s, g) in enumerate(zip(seqs, greedy)):
        if not g:
            tokens[b] = sample(s, logits[b])
    return tokens


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy without penalties or a grammar: the token is the argmax of the logits as they are."""
    return seq.params.greedy and not seq.penalties.active and seq.grammar is None


def verify_tree(seq: Sequence, tree: TokenTree, logits: torch.Tensor, verifier: str,
                argmax: torch.Tensor | None = None) -> tuple[list[int], int]:  # fmt: skip
    """The accepted path (node ids from the root) and the target's token after it. `argmax`:
    the greedy tokens of the logits' rows, when the caller took them already."""
    if seq.penalties.active:  # node u's logits as incremental decoding would after u's path
        logits = seq.penalties.apply(logits, seq.output_ids, tree.branches())
    if seq.grammar is not None:  # and masked by the grammar's state after u's path
        logits = seq.grammar.mask_tree(logits, tree)
    if seq.params.greedy:
        argmax = greedy_tokens(logits) if argmax is None else argmax
        return verify.verify_greedy(tree.parents, tree.tokens, argmax)
    params = seq.params
    p = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    seed = draw_seed(seq.generator)
    if verifier == "naive":
        return verify.verify_naive(tree.parents, tree.tokens, p, seed)
    q = torch.stack(tree.q_rows) if tree.q_rows else None
    proposals = (tree.prop_parent, tree.prop_child, tree.prop_q)
    return verify.verify_stochastic(tree.parents, tree.tokens, p, proposals, q, seed)
