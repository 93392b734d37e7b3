"""DSI's offline simulation (specinfer.dsi.sim): Equation 1 as the paper applies it, SI's expected
tokens per iteration, and Theorem 1 (never slower than non-SI) on random configurations."""

import random
import statistics

import pytest

from specinfer.dsi.sim import (
    RowCost,
    best_lookahead,
    chain_acceptance,
    draw_correct,
    dsi,
    min_lookahead,
    non_si,
    si,
    sp_needed,
)


def test_equation_1_gives_the_papers_lookaheads():
    # A drafter of 5% latency: SP 4 needs lookahead 5 (Appendix D); SP 3, lookahead 7 (Section 4).
    assert min_lookahead(1.0, 0.05, 4) == 5 and sp_needed(1.0, 0.05, 5) == 4
    assert min_lookahead(1.0, 0.05, 3) == 7
    assert min_lookahead(1.0, 0.5, 7) == 1  # a slow drafter: every token verified at once
    with pytest.raises(ValueError, match="SP degree must be at least 1"):
        min_lookahead(1.0, 0.05, 0)


def test_si_yields_the_expected_tokens_per_iteration():
    rng, a, k = random.Random(1), 0.7, 4
    expected = (1 - a ** (k + 1)) / (1 - a)  # accepted drafts (at most k) + the target's token
    n, drafter = 2000, 0.1
    times = [si(n, 1.0, drafter, draw_correct(n, a, rng), k) for _ in range(20)]
    iterations = statistics.mean(times) / (k * drafter + 1.0)
    assert n / iterations == pytest.approx(expected, rel=0.03)


def test_dsi_with_a_useless_drafter_is_exactly_non_si():
    correct = draw_correct(30, 0.0, random.Random(0))
    run = dsi(30, 1.0, 0.1, correct, lookahead=2, sp=4)
    assert run.latency == pytest.approx(non_si(30, 1.0)) and run.tokens == 30


def test_dsi_with_a_perfect_drafter_waits_only_for_the_drafter():
    correct = draw_correct(50, 1.0, random.Random(0))
    lookahead = min_lookahead(1.0, 0.05, 7)
    run = dsi(50, 1.0, 0.05, correct, lookahead, sp=7)
    # Drafting the 49 tokens before the last (in whole blocks), then one verification.
    blocks = -(-49 // lookahead)
    assert run.latency == pytest.approx(blocks * lookahead * 0.05 + 1.0)
    assert run.idle_waits == 0  # Equation 1: no task waited for a server


def test_theorem_1_dsi_is_never_slower_than_non_si_and_beats_si_in_expectation():
    rng = random.Random(7)
    for _ in range(60):
        drafter, acceptance, sp = rng.uniform(0.02, 1.0), rng.random(), rng.randint(1, 7)
        lookahead = min_lookahead(1.0, drafter, sp)
        dsi_t, si_t = [], []
        for _ in range(20):
            correct = draw_correct(40, acceptance, rng)
            run = dsi(40, 1.0, drafter, correct, lookahead, sp)
            assert run.latency <= non_si(40, 1.0) + 1e-9, (drafter, acceptance, sp)
            assert run.tokens == 40
            dsi_t.append(run.latency)
            si_t.append(si(40, 1.0, drafter, correct, lookahead))
        assert statistics.mean(dsi_t) <= statistics.mean(si_t) + 1e-9, (drafter, acceptance, sp)


def test_where_si_is_slower_than_non_si_dsi_is_not():
    rng = random.Random(3)  # a slow drafter (70% of the target) accepted 3 times in 10
    draws = [draw_correct(50, 0.3, rng) for _ in range(100)]
    si_t = statistics.mean(si(50, 1.0, 0.7, c, 1) for c in draws)
    dsi_t = statistics.mean(dsi(50, 1.0, 0.7, c, min_lookahead(1.0, 0.7, 7), 7).latency
                            for c in draws)  # fmt: skip
    assert si_t > non_si(50, 1.0) > dsi_t


def test_row_cost_interpolates_measured_points_and_extends_the_last_segment():
    cost = RowCost({1: 1.0, 3: 1.4, 5: 1.6})
    assert [cost(r) for r in (1, 2, 3, 4, 5)] == pytest.approx([1.0, 1.2, 1.4, 1.5, 1.6])
    assert cost(9) == pytest.approx(2.0) and cost(0) == 1.0
    assert RowCost({2: 3.0})(7) == 3.0
    with pytest.raises(ValueError, match="rows >= 1"):
        RowCost({0: 1.0})


def test_forwards_cost_their_rows():
    cost = RowCost({1: 1.0, 3: 2.0})
    never = [True] + [False] * 10  # every draft rejected: one token per forward
    assert si(3, cost, 0.1, never, 2) == pytest.approx(3 * (0.2 + 2.0))
    assert non_si(4, cost) == 4.0
    # DSI with a useless drafter: a one-row task per token, and blocks that are always wasted.
    assert dsi(5, cost, 0.1, never, 2, 4).latency == pytest.approx(non_si(5, cost))


def test_best_lookahead_shortens_blocks_when_rows_cost():
    flat, steep = 1.0, RowCost({1: 1.0, 2: 1.1, 5: 1.5, 11: 2.2})  # steep: a 2-core CPU's
    for sp in (1, 2):
        eq1 = min_lookahead(1.0, 0.1, sp)
        k_flat, k_steep = best_lookahead(flat, 0.1, sp, 0.6), best_lookahead(steep, 0.1, sp, 0.6)
        assert 1 <= k_steep < k_flat <= eq1
        draws = [draw_correct(64, 0.6, random.Random(i)) for i in range(40)]
        at = {k: statistics.mean(dsi(64, steep, 0.1, c, k, sp).latency for c in draws)
              for k in (k_steep, eq1)}  # fmt: skip
        assert at[k_steep] < at[eq1]


def test_chain_acceptance_counts_a_side_candidate_as_one_more_token():
    assert chain_acceptance(30, 30, 50) == pytest.approx(0.6)  # one candidate a level
    assert chain_acceptance(0, 0, 0) == 0.0
    # Main accepted 20 of 50; another candidate in 15 of the other 30: rounds yield
    # (1 + 0.5) / (1 - 0.4) = 2.5 tokens, as i.i.d. positions at 0.6 do.
    assert chain_acceptance(35, 20, 50) == pytest.approx(0.6)
