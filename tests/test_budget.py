"""The cost-aware tree cut (TreeBudget): which nodes it keeps and what it learns. Decoding with
it is checked lossless in test_speculative (greedy and sampling)."""

import pytest
import torch

from specinfer.budget import PATIENCE, TreeBudget
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

GREEDY = [SamplingParams()]


def _chain(tokens, source=0, tree=None):
    tree = tree or TokenTree(9)
    node = 0
    for t in tokens:
        node = tree.propose(node, t, -1, source)
    return tree


class SteepCosts(TreeBudget):
    """Fixed prices: a forward costs 1 + steepness * width^2, a step 1 besides; nothing is
    timed. Counts the nodes it cuts."""

    cut = 0

    def __init__(self, steepness=0.25):
        super().__init__()
        self.steepness = steepness

    def estimate(self, batch, width):
        return 1.0 + self.steepness * width * width

    def time_step(self, *timings):
        self.rest = 1.0

    def choose(self, trees, params, draft_s=None):
        kept = super().choose(trees, params, draft_s)
        self.cut += sum(len(t) - len(k) for t, k in zip(trees, kept))
        return kept


def test_subtree_keeps_nodes_proposals_and_sources():
    tree = _chain([1, 2, 3], source=0)
    tree.propose(0, 4, -1, 1)  # node 4, depth 1, from SSM 1
    tree.propose(1, 5, -1, 1)  # node 5, under node 1
    tree.propose(1, 2, -1, 1)  # a second proposal of node 2
    sub, new_id = tree.subtree([0, 1, 2, 4])
    assert new_id == [0, 1, 2, -1, 3, -1]
    assert sub.tokens == [9, 1, 2, 4] and sub.parents == [-1, 0, 1, 0]
    assert sorted(zip(sub.prop_child, sub.prop_source)) == [(1, 0), (2, 0), (2, 1), (3, 1)]
    with pytest.raises(ValueError, match="their parents"):
        tree.subtree([0, 2])


def test_flat_costs_keep_everything_steep_costs_cut():
    tree = _chain([1, 2, 3, 4, 5, 6])
    flat = TreeBudget()
    flat.rest, flat.cost = 0.001, {w: 0.02 for w in range(1, 8)}
    assert flat.choose([tree], GREEDY) == [list(range(7))]
    steep = SteepCosts()
    steep.time_step(1, 1, 0, 0)
    kept = steep.choose([tree], GREEDY)[0]
    assert kept[0] == 0 and 1 < len(kept) < 7
    assert kept == list(range(len(kept)))  # a chain is cut at a depth


def test_cut_keeps_the_most_valuable_nodes_and_their_parents():
    """Two drafters: one always accepted, one never; the cut keeps the first one's nodes."""
    budget = SteepCosts()
    budget.time_step(1, 1, 0, 0)
    for _ in range(20):
        tree = _chain([1, 2, 3], source=0)
        _chain([4, 5, 6], source=1, tree=tree)
        budget.observe([tree], [[0, 1, 2, 3]])  # the first drafter's chain
    assert budget.rate(0, 3) > 0.9 and budget.rate(1, 1, contested=True) < 0.1
    tree = _chain([7, 8, 9], source=0)
    _chain([4, 5, 6], source=1, tree=tree)
    kept = budget.choose([tree], GREEDY)[0]
    assert [tree.prop_source[tree.prop_child.index(n)] for n in kept[1:]] == [0] * (len(kept) - 1)
    for _ in range(50):  # random trees: whatever is kept, its parents are kept
        tree = TokenTree(0)
        for t in range(12):
            tree.propose(int(torch.randint(len(tree), ())), t, -1, t % 2)
        kept = set(budget.choose([tree], GREEDY)[0])
        assert 0 in kept and all(tree.parents[n] in kept for n in kept - {0})


def test_sampled_proposals_and_seeded_sampling_are_never_cut():
    tree = _chain([1, 2, 3, 4, 5])
    budget = SteepCosts()
    budget.time_step(1, 1, 0, 0)
    whole = [list(range(len(tree)))]
    assert budget.choose([tree], GREEDY) != whole  # the price cuts this chain...
    unseeded, seeded = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=3)
    assert budget.choose([tree], [unseeded]) != whole
    # ...not a seeded sampling request's; the forward is as wide as that tree, and the greedy
    # one beside it is cut no narrower (those rows are paid for) but still cut
    short = _chain([1, 2])
    greedy_kept, seeded_kept = budget.choose([tree, short], [SamplingParams(), seeded])
    assert seeded_kept == [0, 1, 2] and 3 <= len(greedy_kept) < len(tree)
    assert budget.choose([tree, tree], [SamplingParams(), seeded]) == whole * 2
    assert budget.choose([tree], [SamplingParams(seed=3)]) != whole  # greedy: seed irrelevant
    tree.propose(0, 6, tree.add_distribution(torch.rand(10)))
    assert budget.choose([tree], GREEDY) == [list(range(len(tree)))]


def test_untimed_widths_are_priced_optimistically():
    budget = TreeBudget()
    assert budget.estimate(1, 5) == 0.0  # nothing timed: everything is verified
    budget.time_step(1, 4, 0.5, 0.0)  # the first forward of a width records graphs: skipped
    assert budget.cost == {}
    budget.time_step(1, 4, 0.040, 0.0)
    assert budget.estimate(1, 4) == 0.040
    assert budget.estimate(1, 8) == 0.040  # no wider forward costs less
    assert budget.estimate(1, 2) == pytest.approx(0.020)  # nor less per row
    assert budget.estimate(2, 2) == 0.040  # priced by rows: 2 x 2 is 4 rows too
    assert budget.estimate(4, 2) == 0.040  # 8 rows: no cheaper than 4
    budget.time_step(1, 4, 10.0, 0.0)  # a stall counts at most twice the estimate
    assert budget.estimate(1, 4) == pytest.approx(0.75 * 0.040 + 0.25 * 0.080)


def test_a_forward_is_priced_by_its_first_run_where_the_runner_says_it_ran_warm():
    """A fresh engine at 16 requests verifies whole trees until a forward is priced; a tree of
    336 rows runs eagerly (too wide for a graph), so its first run prices it (warm=True), and
    the next step is cut. One that recorded a graph (warm=False) is never counted."""
    tree = _chain([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    budget = TreeBudget()
    budget.time_step(16, 21, 1.3, 0.001, None, warm=None)  # unknown: a first shape is skipped
    assert budget.cost == {} and budget.choose([tree] * 16, GREEDY * 16) == [list(range(11))] * 16
    budget.time_step(16, 11, 0.9, 0.001, None, warm=True)
    assert budget.cost == {176: 0.9}
    kept = budget.choose([tree] * 16, GREEDY * 16)
    assert all(len(k) < len(tree) for k in kept)  # priced: no longer verified whole
    budget.time_step(16, 1, 0.5, 0.001, None, warm=False)  # recorded its graph: not counted
    budget.time_step(16, 1, 0.5, 0.001, None, warm=False)  # nor later (a graph recorded again)
    assert 16 not in budget.cost
    budget.time_step(16, 1, 0.05, 0.001, None)  # seen before: counted, as without `warm`
    assert budget.cost[16] == 0.05


def test_untimed_widths_between_and_beyond_timed_ones_follow_their_lines():
    budget = TreeBudget()
    for rows, seconds in ((1, 0.020), (4, 0.026), (8, 0.040)):
        budget.cost[rows] = seconds
    assert budget.estimate(1, 2) == pytest.approx(0.022)  # between 1 and 4 rows
    assert budget.estimate(3, 2) == pytest.approx(0.033)  # 6 rows: between 4 and 8
    assert budget.estimate(1, 16) == pytest.approx(0.040 + 8 * 0.0035)  # the 4 -> 8 slope on
    budget.cost = {1: 0.050, 2: 0.040}  # a falling line (noise) is not followed down
    assert budget.estimate(1, 6) == pytest.approx(0.040)
    # Two close counts are noise apart: the line runs back to one at most half as large, so
    # 16 trees of 23 nodes are not priced like a plain step of 16 (measured: 1.19 s).
    budget.cost = {1: 0.024, 15: 0.0896, 16: 0.0797}
    assert budget.estimate(16, 23) == pytest.approx(0.0797 + 352 * (0.0797 - 0.024) / 15)


def _sized(streamed: bool) -> TreeBudget:
    """A budget that has timed its forwards: target rows nearly free (weights streamed, the
    forward bound by a 200 ms read) or costly (resident on a CPU: 20 ms + 6 ms a row)."""
    budget = TreeBudget()
    budget.rest, budget.level_s = 0.001, {0: 0.002}
    for rows in (1, 2, 4, 8, 16, 32, 64):
        budget.cost[rows] = max(0.200, 0.010 + 0.006 * rows) if streamed else 0.014 + 0.006 * rows
    for depth in range(1, 9):  # best children accepted 6 times in 10 at every depth, second 2
        for rank, accepted in ((0, 60.0), (1, 20.0)):
            key = (0, depth, rank, False)  # drafter, depth, rank, contested
            budget.tested[key], budget.accepted[key] = 100.0, accepted
    return budget


def test_sized_trees_grow_where_rows_are_cheap_and_stay_shallow_where_they_cost():
    widths = (2, 2, 2, 1, 1, 1, 1, 1)
    assert _sized(streamed=True).rate(0, 5, 1) == pytest.approx(0.2, abs=0.01)  # as set up
    deep, shallow = _sized(streamed=True).depth(0, widths, 1), _sized(False).depth(0, widths, 1)
    assert deep >= 4 and shallow <= 2, (deep, shallow)
    # A batch of 16 makes every row count (16 rows a level): the tree shrinks.
    assert _sized(streamed=True).depth(0, widths, 16) < deep
    # Nothing timed: one level, to learn what rows cost before growing.
    assert TreeBudget().depth(0, widths, 1) == 1


def test_sized_levels_are_timed_per_request_and_level():
    budget = TreeBudget()
    budget.time_levels(0, 3, 0.016, 2)  # 3 levels + the forward under the root, 2 requests
    assert budget.level_s[0] == pytest.approx(0.002)
    budget.time_levels(0, 0, 5.0, 2)  # nothing drafted: nothing learned
    assert budget.level_s[0] == pytest.approx(0.002)


def test_a_drafter_whose_nodes_are_all_cut_stops_and_is_retried_ever_less_often():
    def draft(run):  # drafter 0 proposes 1 2 3, drafter 1 (when it drafts) 4 5 6
        tree = _chain([1, 2, 3], source=0)
        return _chain([4, 5, 6], source=1, tree=tree) if 1 in run else tree

    budget = SteepCosts()
    budget._could_pay = lambda drafter, batch, backlog: True  # priced in the tests further down
    budget.time_step(1, 1, 0, 0)
    budget.observe([draft({1})] * 30, [[0, 1, 2, 3]] * 30)  # drafter 0 accepted, 1 never
    runs = []
    for _ in range(18):
        runs.append(budget.drafts(2))
        assert 1 in budget.choose([draft(runs[-1])], GREEDY)[0]  # drafter 0's nodes are kept
    assert all(0 in run for run in runs)
    # drafter 1: 4 steps with every node cut, then it drafts again after 2, 4 and 8 skipped steps
    pattern = [True] * 4 + [False, True] + [False] * 3 + [True] + [False] * 7 + [True]
    assert [1 in run for run in runs] == pattern
    budget.observe([draft({1})] * 30, [[0, 4, 5, 6]] * 30)  # now drafter 1 is accepted...
    budget.choose([draft({1})], GREEDY)  # ...and the cut keeps its nodes: it drafts every step
    assert all(budget.drafts(2) == {0, 1} for _ in range(10))
    assert TreeBudget().drafts(3) == {0, 1, 2}  # nothing learned: everyone drafts


def test_drafting_that_costs_more_than_it_gains_stops_though_its_nodes_are_kept():
    """The cut keeps nodes (the drafting is spent), but plain decoding, which drafts nothing,
    would have been faster: after PATIENCE such steps no drafter drafts; a cheap drafting
    keeps drafting."""
    tree = _chain([1, 2, 3])
    for drafting, stops in ((3.0, True), (0.2, False)):
        budget = SteepCosts()
        budget.time_step(1, 1, 0, 0)
        budget.drafting = drafting  # rest 1, forward 1 + w^2 / 4: plain decoding 1 / 2.25
        budget.observe([tree] * 30, [[0, 1]] * 30)  # depth 1 nearly always accepted
        runs = []
        for _ in range(5):
            runs.append(budget.drafts(1))
            if 0 in runs[-1]:
                assert len(budget.choose([tree], GREEDY)[0]) > 1  # a node is kept
        assert [0 in run for run in runs] == [True] * 4 + [not stops]


def test_stopped_drafters_are_those_idle_for_patience_steps():
    budget = TreeBudget()
    budget._idle = {0: PATIENCE, 1: PATIENCE - 1, 2: 0}
    assert budget.stopped() == {0}


def _steps(budget, draft, draft_s, n=5):
    """n steps of two drafters: which drafted at each, and what the cut kept of draft()."""
    runs, kept = [], []
    for _ in range(n):
        runs.append(budget.drafts(2))
        kept.append(budget.choose([draft()], GREEDY, draft_s=draft_s)[0])
    return runs, kept


def test_a_drafter_carried_by_a_cheaper_ones_nodes_stops_on_its_own_cost():
    """Drafter 0 (prompt lookup: nearly free) proposes 1 2 3, always accepted; drafter 1 (an SSM)
    proposes 4, accepted 1 time in 3. The step pays and the cut keeps node 4 either way; drafter
    1 keeps drafting only while what node 4 adds is worth its own drafting time."""

    def draft():
        tree = _chain([1, 2, 3], source=0)
        tree.propose(0, 4, -1, 1)
        return tree

    for ssm_s, stops in ((3.0, True), (0.05, False)):
        budget = SteepCosts(steepness=0.001)  # rows nearly free: the cut keeps every node
        budget.time_step(1, 1, 0, 0)
        for i in range(30):
            budget.observe([draft()], [[0, 1, 2, 3] if i % 3 else [0, 4]])
        runs, kept = _steps(budget, draft, [0.001, ssm_s])
        assert all(4 in k and 3 in k for k in kept)  # the cut keeps both drafters' nodes
        assert all(0 in run for run in runs)
        assert [1 in run for run in runs] == [True] * 4 + [not stops]


def test_a_drafter_stops_when_its_drafting_and_its_rows_together_cost_more_than_it_adds():
    """Drafter 0 (nearly free) proposes 1 2 3, drafter 1 proposes 4; each path is accepted half
    the time, and each row costs. The cut keeps node 4 (its drafting is spent by then) and node
    4 is worth more than drafter 1's drafting time yields at the step's rate (0.2 s: 0.18
    tokens), but not more than that time and its row together: drafter 1 stops. Cheaper
    drafting (0.01 s) pays."""

    def draft():
        return _chain([4], source=1, tree=_chain([1, 2, 3], source=0))

    for ssm_s, stops in ((0.2, True), (0.01, False)):
        budget = SteepCosts(steepness=0.05)
        budget.time_step(1, 1, 0, 0)
        for i in range(30):
            budget.observe([draft()], [[0, 1, 2, 3] if i % 2 else [0, 4]])
        runs, kept = _steps(budget, draft, [0.001, ssm_s])
        assert all(4 in k for k in kept)
        assert all(0 in run for run in runs)
        assert [1 in run for run in runs] == [True] * 4 + [not stops]


def test_of_two_drafters_proposing_the_same_nodes_the_costlier_stops_the_other_drafts_on():
    """Drafters 0 and 1 (say two SSMs) both propose 1 2 3, nearly always accepted: neither
    proposes a node of its own, yet either alone pays its drafting time. The costlier one stops
    after PATIENCE steps; the other, judged without it, keeps drafting, also in the step the
    costlier one is retried."""
    budget = SteepCosts(steepness=0.001)  # rows nearly free: the cut keeps every node
    budget.time_step(1, 1, 0, 0)
    both = _chain([1, 2, 3], source=1, tree=_chain([1, 2, 3], source=0))
    budget.observe([both] * 30, [[0, 1, 2, 3]] * 30)
    runs = []
    for _ in range(8):
        runs.append(budget.drafts(2))
        tree = TokenTree(9)
        for source in sorted(runs[-1]):
            _chain([1, 2, 3], source=source, tree=tree)
        budget.choose([tree], GREEDY, draft_s=[0.6, 0.5])
        assert budget._idle[1] == 0  # not even when drafter 0 drafts again on trial
    assert all(1 in run for run in runs)
    assert [0 in run for run in runs[: PATIENCE + 1]] == [True] * PATIENCE + [False]
    assert budget.stopped() == {0}


def test_of_two_drafters_as_good_the_one_with_the_longer_back_off_leaves():
    """Drafters 0 and 1 propose the same chain at the same cost: one must leave, and the one
    stopped more often lately (the longer back-off) does, so the two do not take turns."""
    both = _chain([1, 2, 3], source=1, tree=_chain([1, 2, 3], source=0))
    for challenger in (0, 1):
        budget = SteepCosts(steepness=0.001)
        budget.time_step(1, 1, 0, 0)
        budget.observe([both] * 30, [[0, 1, 2, 3]] * 30)
        budget._explore = {challenger: 8}
        budget.choose([both], GREEDY, draft_s=[0.5, 0.5])
        assert budget._idle == {challenger: 1, 1 - challenger: 0}


class RowCosts(TreeBudget):
    """A forward costs 10 ms plus 1 ms per row (requests x width); nothing is timed."""

    def estimate(self, batch, width):
        return 0.010 + 0.001 * batch * width


def test_a_stopped_drafter_is_not_retried_where_its_trees_cannot_pay():
    """Retrying costs a forward as wide as the tree for every request: at 16 requests a tree
    like its last one cannot pay, at 1 it can."""
    for batch, retried in ((16, False), (1, True)):
        budget = _stopped()
        assert any(0 in budget.drafts(1, batch) for _ in range(10)) == retried


def _stopped(catch_up_s: float | None = None) -> RowCosts:
    """A budget whose drafter 0 stopped after a chain of 2 (untested: 0.5 and 0.25 tokens
    expected), one that pays at 1 request (RowCosts); catching up cost `catch_up_s` a token."""
    budget = RowCosts()
    budget.rest, budget.draft_each = 0.001, {0: 0.002}
    budget._last_tree[0] = _chain([1, 2])
    budget._idle[0] = PATIENCE
    if catch_up_s is not None:
        budget.catch_up_s[0] = catch_up_s
    return budget


def test_a_stopped_drafter_is_retried_only_where_it_earns_back_its_catch_up():
    """A retry first feeds what the drafter skipped (a stopped SSM: every token since, prompts
    included). A step drafting the chain saves ~5 ms against plain decoding here, so 10 tokens
    at 1 ms are earned back within the back-off's 4 steps, 1000 not even within 64."""
    for backlog, retried in ((10, True), (1000, False)):
        budget = _stopped(catch_up_s=0.001)
        runs = [budget.drafts(1, 1, [backlog]) for _ in range(200)]
        assert any(0 in run for run in runs) == retried
    # Not learned yet: priced as free (the first retry learns it).
    budget = _stopped()
    assert any(0 in budget.drafts(1, 1, [1000]) for _ in range(10))


@pytest.mark.parametrize("kept", [True, False])
def test_what_catching_up_costs_is_learned_at_a_retry(kept):
    """The retry's drafting took 52 ms where drafting alone takes 2: 50 ms for the 50 tokens it
    fed first. That prices the next retries, whether the cut kept the retry's nodes or not; it
    is not what the drafter's drafting costs."""
    budget = _stopped()
    assert budget.drafts(1, 1, [0]) == set()  # the back-off's first step
    assert budget.drafts(1, 1, [50]) == {0}
    if not kept:  # meanwhile its chains turn out never accepted: the cut drops the retry's
        budget.observe([_chain([1, 2])] * 30, [[0]] * 30)
    chosen = budget.choose([_chain([1, 2])], GREEDY, draft_s=[0.052])
    assert (len(chosen[0]) > 1) == kept
    assert budget.catch_up_s[0] == pytest.approx(0.001)
    assert budget.draft_each[0] == 0.002


def test_a_stopped_drafter_is_retried_by_what_its_own_nodes_are_worth():
    """Drafter 0 (an SSM whose chains are accepted) was stopped; meanwhile drafter 1 (prompt
    lookup) drafts nodes never accepted. Whether drafter 0's retry could pay is priced by its
    own last tree, not by the trees drafted while it was stopped, which hold none of its nodes
    (priced by those, it was refused until the batch shrank): it is retried after the
    back-off, and back for good once its nodes are kept again."""
    budget = RowCosts()
    budget.rest = 0.001
    budget.observe([_chain([1, 2, 3])] * 30, [[0, 1, 2, 3]] * 30)
    budget.observe([_chain([7], source=1)] * 30, [[0]] * 30)
    budget.choose([_chain([1, 2, 3])], GREEDY, draft_s=[0.002, 0.0])
    budget._idle[0], budget._explore[0] = PATIENCE, 16  # stopped: retried after 16 steps
    runs = []
    for _ in range(18):
        runs.append(budget.drafts(2))
        tree = _chain([1, 2, 3]) if 0 in runs[-1] else TokenTree(9)
        budget.choose([_chain([7], source=1, tree=tree)], GREEDY, draft_s=[0.002, 0.0001])
    assert budget.rate(1, 1) < 0.1  # the trees without drafter 0 were worth nothing
    assert [0 in run for run in runs] == [False] * 15 + [True] * 3


def test_a_fresh_budget_keeps_a_drafter_that_pays_through_its_first_timings():
    """A fresh engine drafts from its first step: plain decoding has not run, the first forward
    of each width and the drafter's first forwards record graphs (the drafting ten times its
    later cost). A drafter whose chains are accepted to depth 2 (forward 9 ms + 1 ms a row,
    drafting 1.4 ms) must not be stopped on those guesses."""
    budget = TreeBudget()
    runs = []
    for step in range(20):
        runs.append(budget.drafts(1))
        tree = _chain([1, 2, 3, 4]) if runs[-1] else TokenTree(9)
        draft_s = (0.011 if step == 0 else 0.0014) if runs[-1] else 0.0
        kept = budget.choose([tree], GREEDY, draft_s=[draft_s])[0]
        budget.observe([tree], [[0, 1, 2]])
        width = len(kept)
        budget.time_step(1, width, 0.009 + 0.001 * width, 0.0002, draft_s if runs[-1] else None)
    assert all(0 in run for run in runs)


def test_one_stalled_step_does_not_stop_a_drafter_that_pays():
    """A step stalled for 0.3 s (a full garbage collection) while a drafter that pays (1.4 ms a
    step, its chains accepted to depth 2) drafted, or while the target ran: every timing counts
    it at most twice its average, so the drafter drafts on."""
    for stalled in ("drafting", "forward", "rest"):
        budget = TreeBudget()
        runs = []
        for step in range(40):
            runs.append(budget.drafts(1))
            tree = _chain([1, 2, 3, 4]) if runs[-1] else TokenTree(9)
            stall = 0.3 if step == 20 else 0.0
            draft_s = 0.0014 + (stall if stalled == "drafting" else 0.0)
            kept = budget.choose([tree], GREEDY, draft_s=[draft_s if runs[-1] else 0.0])[0]
            budget.observe([tree], [[0, 1, 2]])
            width = len(kept)
            forward = 0.009 + 0.001 * width + (stall if stalled == "forward" else 0.0)
            rest = 0.0002 + (stall if stalled == "rest" else 0.0)
            budget.time_step(1, width, forward, rest, draft_s if runs[-1] else None)
        assert all(0 in run for run in runs), stalled


def test_rates_follow_the_verifications():
    budget = TreeBudget()
    assert budget.rate(0, 1) == budget.rate(0, 2) == 0.5
    for _ in range(30):
        tree = _chain([1, 2, 3])
        budget.observe([tree], [[0, 1]])  # depth 1 accepted, depth 2 rejected, 3 untested
    r1, r2, r3 = (budget.rate(0, d) for d in (1, 2, 3))
    assert r1 > 0.9 and r2 < 0.15
    assert r3 == pytest.approx(r2)  # never tested: leans on the depth above


def test_rates_are_learned_apart_where_drafters_disagree():
    """Two drafters: where they propose the same token it is always accepted, where they
    propose different ones neither is. A node two drafters disagree on is valued by the rate of
    disagreements, not by its drafter's rate overall (0.5 for both here)."""
    budget = TreeBudget()

    def draft(agree):
        tree = _chain([1], source=0)
        return _chain([1 if agree else 2], source=1, tree=tree)

    for i in range(40):
        budget.observe([draft(i % 2)], [[0, 1] if i % 2 else [0]])
    assert budget.values(draft(True))[1] > 0.8
    assert max(budget.values(draft(False))[1:]) < 0.2
    assert budget.rate(0, 1, contested=True) < 0.2 < 0.8 < budget.rate(0, 1)


def test_rates_are_learned_per_rank_among_siblings():
    """A drafter's best child is accepted 8 times in 10, its second 1 in 10: the cut values them
    apart (one rate per depth would price both at 0.45)."""
    budget = TreeBudget()
    for i in range(50):
        tree = TokenTree(9)
        tree.propose(0, 1, -1, 0)  # rank 0
        tree.propose(0, 2, -1, 0)  # rank 1
        accepted = 1 if i % 10 < 8 else 2 if i % 10 == 8 else None
        budget.observe([tree], [[0, accepted] if accepted else [0]])
    assert budget.rate(0, 1, 0) == pytest.approx(0.8, abs=0.05)
    assert budget.rate(0, 1, 1) == pytest.approx(0.1, abs=0.05)
    tree = TokenTree(9)
    tree.propose(0, 1, -1, 0)
    tree.propose(0, 2, -1, 0)
    assert budget.values(tree) == pytest.approx([1.0, budget.rate(0, 1, 0), budget.rate(0, 1, 1)])


def test_a_refused_retry_backs_off_until_the_batch_shrinks():
    """At 16 requests a stopped drafter's retry is refused on paper; the refusal is not priced
    again at every step (it backs off like a failed retry), but a smaller batch asks at once."""
    budget = RowCosts()
    budget._idle[0] = PATIENCE
    asked = []
    budget._could_pay = lambda drafter, batch, backlog: asked.append(batch) or batch == 1
    assert not any(0 in budget.drafts(1, 16) for _ in range(60))
    assert 4 <= len(asked) <= 6  # after 2, 4, 8, 16, 32 skipped steps: not 60 times
    assert budget.drafts(1, 1) == {0}  # the batch shrank: asked now, and it could pay


def test_a_width_priced_out_by_one_slow_timing_is_tried_again():
    """Width 2 once timed in a slow moment (34 ms, against 22 ms really) looks unprofitable for
    a node accepted half the time, so it is never chosen, never timed again: its price leans
    towards the plain step's as plain steps go by, until it is tried and re-timed."""
    budget = TreeBudget()
    tree = _chain([1])
    budget.observe([tree] * 50, [[0, 1]] * 25 + [[0]] * 25)  # accepted half the time
    for width, seconds in ((1, 0.020), (1, 0.020), (2, 0.034), (2, 0.034)):
        budget.time_step(1, width, seconds, 0.001)  # the first of each shape is not counted
    assert len(budget.choose([tree], GREEDY)[0]) == 1  # 1.5 tokens in 35 ms < 1 in 21 ms
    plain_steps = 0
    while len(budget.choose([tree], GREEDY)[0]) == 1:
        budget.time_step(1, 1, 0.020, 0.001)
        plain_steps += 1
        assert plain_steps < 100
    assert plain_steps > 10  # not at once: a real price is not forgotten in a few steps
    budget.time_step(1, 2, 0.022, 0.001)  # tried: it costs 22 ms, and is chosen from now on
    assert len(budget.choose([tree], GREEDY)[0]) == 2


def test_only_a_near_row_count_makes_a_stale_price_lean():
    """A stale price leans towards the next smaller count's only if that count has at least half
    as many rows: 176 rows (a whole tree for 16 requests) is not priced like 39."""
    budget = TreeBudget()
    budget.cost = {16: 0.080, 24: 0.120, 39: 0.140, 176: 0.750}
    budget._seen.add((16, 1))
    for _ in range(300):
        budget.time_step(16, 1, 0.080, 0.001)
    assert budget.cost[176] == 0.750
    assert budget.cost[24] == pytest.approx(0.080, abs=3e-3)  # 24 <= 2 x 16: leans to 80 ms
    assert budget.cost[39] < 0.090  # 39 > 2 x 16, but 39 <= 2 x 24: it follows 24


def test_nodes_are_priced_by_their_drafters_confidence_once_it_is_learned():
    """A drafter's sure proposals (probability 0.95) are accepted 9 times in 10, its unsure ones
    (0.05) 1 in 10, at the same depth and rank: the cut values them apart by the confidence bin
    (one rate for depth 1 would price both at 0.5), keeps the sure chain deep and drops the
    unsure one, and the rate by depth still pools them all (what `depth` plans with)."""
    budget = SteepCosts(steepness=0.05)

    def draft(conf, tokens=(1,)):
        tree, node = TokenTree(9), 0
        for t in tokens:
            node = tree.propose(node, t, -1, 0, conf)
        return tree

    for i in range(200):
        conf = 0.95 if i % 2 else 0.05
        hit = (i // 2) % 10 < (9 if i % 2 else 1)
        budget.observe([draft(conf)], [[0, 1] if hit else [0]])
    assert budget.values(draft(0.95))[1] == pytest.approx(0.9, abs=0.05)
    assert budget.values(draft(0.05))[1] == pytest.approx(0.1, abs=0.05)
    assert budget.values(draft(0.95), confident=False)[1] == pytest.approx(0.5, abs=0.05)
    assert budget.rate(0, 1) == pytest.approx(0.5, abs=0.05)
    assert budget.choose([draft(0.95, (1, 2, 3))], GREEDY) == [[0, 1, 2, 3]]
    assert budget.choose([draft(0.05, (1, 2, 3))], GREEDY) == [[0]]
    # An untested bin starts at its middle: a drafter's probability is a fair first guess.
    assert TreeBudget().confident_rate(0, 7) == pytest.approx(0.75)


def test_a_node_the_cut_dropped_counts_as_accepted_if_it_was_the_targets_next_token():
    """Rates are learned from the trees as drafted: a node cut away under the accepted path's
    end was accepted if the target then took its token (it would have been), else rejected;
    only nodes whose parent was accepted count as tested."""
    tree = _chain([1, 2, 3])
    tree.propose(0, 4, -1, 0)  # node 4: depth 1, rank 1
    for taken, accepted_at_2 in ((3, 1.0), (7, 0.0)):
        budget = TreeBudget()
        budget.observe([tree], [[0, 1, 2]], next_tokens=[taken])  # node 3 was cut, say
        assert budget.tested[(0, 3, 0, False)] == 1.0
        assert budget.accepted[(0, 3, 0, False)] == accepted_at_2
        assert budget.tested[(0, 1, 1, False)] == 1.0 and budget.accepted[(0, 1, 1, False)] == 0
    budget = TreeBudget()
    budget.observe([tree], [[0]], next_tokens=[4])  # the target took node 4's token at once
    assert budget.accepted[(0, 1, 1, False)] == 1.0 and budget.accepted[(0, 1, 0, False)] == 0
    assert (0, 2, 0, False) not in budget.tested  # its parent was not accepted
