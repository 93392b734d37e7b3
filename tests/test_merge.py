"""Merge-based token trees (Definition 3.2) and the prompt-lookup (n-gram) drafter."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.ngram import NgramConfig, NgramDrafter
from specinfer.tree import TokenTree, merge_trees

ROOT = 3


@st.composite
def ssm_trees(draw):
    """A tree as one SSM drafts it: sampled proposals (with q rows, duplicates allowed) and
    point-mass proposals, under random parents."""
    tree = TokenTree(ROOT)
    for _ in range(draw(st.integers(0, 20))):
        parent = draw(st.integers(0, len(tree) - 1))
        if draw(st.booleans()):
            row = tree.add_distribution(torch.rand(5))
            for token in draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)):
                tree.propose(parent, token, row)
        else:
            tree.propose(parent, draw(st.integers(0, 4)))
    return tree


def _sequences(tree: TokenTree) -> list[tuple[int, ...]]:
    """The token sequence (root excluded) of every node."""
    seqs = []
    for node in range(len(tree)):
        seq = []
        while node > 0:
            seq.append(tree.tokens[node])
            node = tree.parents[node]
        seqs.append(tuple(reversed(seq)))
    return seqs


def _proposals(tree: TokenTree, source: int | None = None) -> Counter:
    """Multiset of (parent sequence, token, q row values or None[, source])."""
    seqs = _sequences(tree)
    out = Counter()
    for i, (parent, child, q) in enumerate(zip(tree.prop_parent, tree.prop_child, tree.prop_q)):
        if source is not None and tree.prop_source[i] != source:
            continue
        row = None if q < 0 else tuple(tree.q_rows[q].tolist())
        out[(seqs[parent], tree.tokens[child], row)] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(ssm_trees(), min_size=1, max_size=4))
def test_merge_keeps_every_sequence_once_and_every_proposal(trees):
    merged, maps = merge_trees(trees)
    merged_seqs = _sequences(merged)
    assert len(set(merged_seqs)) == len(merged_seqs)  # each sequence exactly once
    assert set(merged_seqs) == {s for t in trees for s in _sequences(t)}  # and nothing else
    for node in range(1, len(merged)):
        assert merged.parents[node] < node  # parents before children
        assert merged.depths[node] == merged.depths[merged.parents[node]] + 1
    assert merged.depths == sorted(merged.depths)  # numbered level by level
    for i, (tree, node_map) in enumerate(zip(trees, maps)):
        own_seqs = _sequences(tree)
        assert [merged_seqs[m] for m in node_map] == own_seqs
        # every proposal of SSM i is kept, with its own distribution and its source
        assert _proposals(merged, source=i) == _proposals(tree)
        for node in range(1, len(tree)):
            assert i in merged.sources(node_map[node])
    assert len(merged.prop_q) == sum(len(t.prop_q) for t in trees)  # duplicates stay separate


def test_merge_of_two_ssms_proposing_the_same_child():
    a, b = TokenTree(ROOT), TokenTree(ROOT)
    qa, qb = (
        a.add_distribution(torch.tensor([0.5, 0.5])),
        b.add_distribution(torch.tensor([1.0, 0])),
    )
    a.propose(a.propose(0, 1, qa), 0)
    b.propose(0, 1, qb)
    b.propose(0, 0, qb)
    merged, maps = merge_trees([a, b])
    assert merged.tokens == [ROOT, 1, 0, 0] and merged.parents == [-1, 0, 0, 1]
    assert maps == [[0, 1, 3], [0, 1, 2]]
    assert merged.sources(1) == {0, 1} and merged.sources(2) == {1}
    # node 1 has two proposals, each with its own SSM's distribution
    assert [(p, c, q) for p, c, q in zip(merged.prop_parent, merged.prop_child, merged.prop_q)
            if c == 1] == [(0, 1, 0), (0, 1, 1)]  # fmt: skip
    assert merged.q_rows[1].tolist() == [1.0, 0.0]


def test_merge_and_cut_keep_each_proposals_confidence():
    a, b = TokenTree(ROOT), TokenTree(ROOT)
    a.propose(a.propose(0, 1, conf=0.9), 2, conf=0.6)
    b.propose(0, 1, conf=0.3)
    b.propose_once(0, 4, conf=0.2)
    b.propose(0, 5)  # no confidence given
    merged, _ = merge_trees([a, b])
    assert merged.tokens == [ROOT, 1, 4, 5, 2]
    assert list(zip(merged.prop_child, merged.prop_source, merged.prop_conf)) == [
        (1, 0, 0.9), (1, 1, 0.3), (2, 1, 0.2), (3, 1, -1.0), (4, 0, 0.6)]  # fmt: skip
    cut, _ = merged.subtree([0, 1, 4])
    assert list(zip(cut.prop_child, cut.prop_source, cut.prop_conf)) == [
        (1, 0, 0.9), (1, 1, 0.3), (2, 0, 0.6)]  # fmt: skip


def test_merge_rejects_different_roots():
    with pytest.raises(ValueError, match="share the root"):
        merge_trees([TokenTree(1), TokenTree(2)])


# -- the n-gram drafter -------------------------------------------------------------------------


def _draft(drafter: NgramDrafter, seq: list[int], max_depth: int = 99) -> TokenTree:
    return drafter.draft([SimpleNamespace(row=0)], [seq], [max_depth])[0]


def _paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Root-to-leaf token sequences."""
    leaves = set(range(len(tree))) - set(tree.parents)
    return {s for node, s in enumerate(_sequences(tree)) if node in leaves}


def test_ngram_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(NgramConfig(max_n=2, depth=3))
    drafter.reset(1, 100)
    #      the bigram (7, 8) occurred twice; the most recent occurrence was followed by 5, 6, 9
    seq = [7, 8, 1, 2, 3, 7, 8, 5, 6, 9, 4, 7, 8]
    tree = _draft(drafter, seq)
    assert _paths(tree) == {(5, 6, 9)}
    assert tree.prop_q == [-1, -1, -1]  # point masses: lossless under VerifyStochastic
    assert _paths(_draft(drafter, seq, max_depth=2)) == {(5, 6)}


def test_ngram_branches_are_distinct_continuations_of_several_matches():
    drafter = NgramDrafter(NgramConfig.parse("ngram:max_n=2,min_n=1,depth=2,branches=3"))
    drafter.reset(2, 100)
    seq = [7, 8, 1, 2, 7, 8, 5, 6, 7, 8, 5, 6, 0, 8]
    # bigram (0, 8) never occurred before: unigram 8 -> continuations (5, 6) twice, then (1, 2)
    tree = _draft(drafter, seq)
    assert _paths(tree) == {(5, 6), (1, 2)}
    assert tree.depths == sorted(tree.depths)
    assert len(tree.prop_child) == len(tree) - 1  # one proposal per node


def test_ngram_index_follows_a_growing_sequence_and_a_new_request():
    drafter = NgramDrafter(NgramConfig(max_n=2, depth=2))
    drafter.reset(1, 100)
    seq = [1, 2, 3, 4]
    assert len(_draft(drafter, seq)) == 1  # no earlier occurrence: nothing proposed
    seq += [1, 2]  # accepted tokens extend the request
    assert _paths(_draft(drafter, seq)) == {(3, 4)}
    drafter.admit(0)  # the row now serves another request: its index starts afresh
    assert len(_draft(drafter, [1, 2])) == 1  # the old request's (1, 2) -> 3 is forgotten


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ngram:depth=0", "depth must be a positive integer"),
        ("ngram:min_n=4,max_n=2", "larger than max_n"),
        ("ngram:width=2", "bad ngram option"),
        ("ngram:depth=x", "must be an integer"),
    ],
)
def test_ngram_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        NgramConfig.parse(spec)
