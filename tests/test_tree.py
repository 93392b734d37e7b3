"""TokenTree and TreeConfig: construction, proposals with multiplicity, the ancestor mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.tree import TokenTree, TreeConfig


def test_paper_default_config():
    cfg = TreeConfig()
    assert cfg.widths == (1, 1, 3, 1, 1, 1, 1, 1)
    assert cfg.num_nodes == 1 + 1 + 1 + 3 * 6  # root, two single levels, then 3 chains of 6
    assert TreeConfig.parse("2, 2,1").widths == (2, 2, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"widths": ()}, "must not be empty"),
        ({"widths": (1, 0, 2)}, "positive integers"),
        ({"widths": (4, 4, 4), "max_nodes": 64}, "85 nodes, more than max_nodes=64"),
        ({"widths": (2, 2), "beam": 0}, "beam must be a positive integer"),
        ({"widths": (2, 2), "beam": 1, "sample_children": True}, "sample_children must be"),
    ],
)
def test_bad_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeConfig(**kwargs)


def test_a_beam_expands_that_many_nodes_a_level():
    cfg = TreeConfig((4, 4, 2, 2), beam=3)
    assert cfg.level_sizes == [4, 12, 6, 6]  # 4 nodes; 3 of them x 4; 3 x 2; 3 x 2
    assert cfg.num_nodes == 1 + 4 + 12 + 6 + 6
    assert TreeConfig((4, 4, 2, 2), max_nodes=128).level_sizes == [4, 16, 32, 64]


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="comma-separated integers"):
        TreeConfig.parse("1,x,3")


def test_duplicate_draws_share_a_node_but_keep_both_proposals():
    tree = TokenTree(7)
    q = tree.add_distribution(torch.tensor([0.5, 0.5]))
    a = tree.propose(0, 1, q)
    b = tree.propose(0, 1, q)
    c = tree.propose(0, 0, q)
    assert a == b == 1 and c == 2 and len(tree) == 3
    assert tree.prop_child == [1, 1, 2] and tree.prop_q == [0, 0, 0]


@st.composite
def random_trees(draw):
    tree = TokenTree(draw(st.integers(0, 9)))
    for _ in range(draw(st.integers(0, 30))):
        parent = draw(st.integers(0, len(tree) - 1))
        tree.propose(parent, draw(st.integers(0, 9)))
    return tree


@settings(max_examples=200, deadline=None)
@given(random_trees())
def test_tree_invariants_and_mask(tree):
    n = len(tree)
    for node in range(1, n):
        parent = tree.parents[node]
        assert parent < node  # parents before children: the depth-first commit relies on it
        assert tree.depths[node] == tree.depths[parent] + 1
    # siblings carry distinct tokens (a node is a unique token sequence)
    for node in range(n):
        kids = [c for c in range(n) if tree.parents[c] == node]
        assert len({tree.tokens[c] for c in kids}) == len(kids)
    mask = tree.ancestor_mask()
    for i in range(n):
        ancestors, node = set(), i
        while node >= 0:
            ancestors.add(node)
            node = tree.parents[node]
        assert {j for j in range(n) if mask[i, j]} == ancestors
        assert mask[i].sum() == tree.depths[i] + 1
    # a sub-mask restricted to given rows/columns agrees with the full one
    rows, cols = list(range(0, n, 2)), list(range(n - 1, -1, -1))
    assert torch.equal(tree.ancestor_mask(rows, cols), mask[rows][:, cols])


def test_chain_mask_is_causal():
    tree = TokenTree(0)
    node = 0
    for t in range(1, 6):
        node = tree.propose(node, t)
    assert torch.equal(tree.ancestor_mask(), torch.ones(6, 6, dtype=torch.bool).tril())
