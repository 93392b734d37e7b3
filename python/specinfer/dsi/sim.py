"""DSI's offline simulation (the DSI paper's Figure 2 analysis): the latency of generating N
tokens with non-SI (the target alone), SI (draft L tokens, then verify them in one target
forward) and DSI (Algorithm 1 with lookahead L over SP target servers), from a target forward's
latency, a drafter forward's latency and the drafter's acceptance rate.

Both speculative methods see the same drafts: `correct[p]` says whether the drafter's token at
position p, drafted after a correct prefix, equals the target's (i.i.d. with the acceptance
rate; common random numbers across methods). Forwards take their fixed latencies; nothing else
costs time (the paper's offline setting; the real orchestrator measures its overheads). A target
forward's latency is a number (the paper: a GPU forward costs the same for a few rows) or a
function of its rows (`RowCost`: on a CPU every row costs; `best_lookahead` then weighs a longer
block's slower forward against its fewer tasks).

DSI, as simulated: after each rejection (and at the start) the drafter drafts one token per
drafter latency from the verified prefix. A target task starts at once on the verified prefix
(it yields the next token: DSI never waits for the drafter), and one at the end of every block
of L drafts, on the prefix drafted so far; a task gives the target's tokens at every position
of its block and the one after (causal attention: a position's token is right whenever the
drafts before it are). Tasks run on the first free of SP servers. A finished task whose block
starts at the verified position verifies it: up to its end, or to the first wrong draft, whose
target token is kept; then every task on the wrong path is terminated (its server freed), and
drafting restarts after the corrected token. A task that finished early waits until the
verified position reaches its block (the paper's lines 13-14: cascades at once). When no task
covers the next position (a drafter slower than the target), one starts there at once on what
is drafted so far.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

Latency = float | Callable[[int], float]  # a target forward's seconds, or seconds for its rows


class RowCost:
    """A target forward's seconds as a function of its rows, from measured points: linear
    between them, and past the last along the last two (a single point: constant)."""

    def __init__(self, seconds: dict[int, float]):
        if not seconds or min(seconds) < 1 or min(seconds.values()) <= 0:
            raise ValueError(f"row costs need rows >= 1 and positive seconds, got {seconds}")
        self.rows, self.seconds = sorted(seconds), [seconds[r] for r in sorted(seconds)]

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        if len(r) == 1 or rows <= r[0]:
            return s[0]
        i = min(bisect.bisect_left(r, rows), len(r) - 1)  # the segment r[i-1]..r[i]
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return max(s[0], s[i - 1] + slope * (rows - r[i - 1]))

    def __repr__(self) -> str:
        return f"RowCost({dict(zip(self.rows, self.seconds))})"


def level_cost(cost: Callable[[int], float], width: float) -> Callable[[int], float]:
    """A forward's seconds by the positions it verifies (what the simulator counts), for a
    drafter with `width` nodes a level: the frontier's row and width rows for each level below."""
    return lambda positions: cost(1 + width * (positions - 1))


def level_width(rows: float, levels: float, tasks: float) -> float:
    """Drafted nodes a level, from measured tasks' rows and levels (a chain, none drafted: 1)."""
    return max(1.0, (rows - tasks) / levels) if levels else 1.0


def _cost(target_s: Latency) -> Callable[[int], float]:
    return target_s if callable(target_s) else lambda rows: target_s


def sp_needed(target_s: float, drafter_s: float, lookahead: int) -> int:
    """Equation 1's left side: target servers busy at once when a verification task is sent
    every `lookahead` drafter forwards."""
    return max(1, math.ceil(target_s / (lookahead * drafter_s) - 1e-9))


def min_lookahead(target_s: float, drafter_s: float, sp: int) -> int:
    """The smallest lookahead that Equation 1 allows with `sp` target servers (the smaller, the
    sooner a rejection is seen)."""
    if sp < 1:
        raise ValueError(f"the SP degree must be at least 1, got {sp}")
    if drafter_s <= 0 or target_s <= 0:
        raise ValueError("latencies must be positive")
    lookahead = 1
    while sp_needed(target_s, drafter_s, lookahead) > sp:
        lookahead += 1
    return lookahead


def chain_acceptance(accepted: int, accepted_main: int, tested: int) -> float:
    """The per-position acceptance to simulate a drafter whose levels hold several candidates:
    a block continues only under the main one; a level where another candidate is accepted
    yields that token and the target's next, then ends like a rejection. The rate whose
    expected tokens per round, 1 / (1 - a), equal (1 + other) / (1 - main) (no drafts: 0)."""
    if not tested:
        return 0.0
    main = accepted_main / tested
    other = (accepted - accepted_main) / max(1, tested - accepted_main)
    return 1 - (1 - main) / (1 + other)


def draw_correct(n: int, acceptance: float, rng: random.Random) -> list[bool]:
    """Whether the drafter's token at each position 1..n+1 (index 0 unused) matches the target's
    after a correct prefix."""
    return [True] + [rng.random() < acceptance for _ in range(n + 1)]


def _right(correct: list[bool], position: int) -> bool:
    """Positions past the drawn ones (past the N tokens asked for) count as wrong."""
    return position < len(correct) and correct[position]


def non_si(n: int, target_s: Latency) -> float:
    return n * _cost(target_s)(1)


def si(n: int, target_s: Latency, drafter_s: float, correct: list[bool], lookahead: int) -> float:
    """Draft `lookahead` tokens, verify them in one target forward, keep the accepted ones and
    the target's next token; repeat."""
    verified, t = 0, 0.0
    while verified < n:
        accepted = 0
        while accepted < lookahead and _right(correct, verified + accepted + 1):
            accepted += 1
        verified += accepted + 1
        t += lookahead * drafter_s + _cost(target_s)(lookahead + 1)
    return t


@dataclass
class DSIRun:
    latency: float = 0.0
    target_forwards: int = 0  # tasks started
    wasted: int = 0  # tasks terminated, or finished without verifying a new position
    rejections: int = 0
    tokens: int = 0
    idle_waits: int = 0  # tasks that waited for a free server


def dsi(n: int, target_s: Latency, drafter_s: float, correct: list[bool], lookahead: int,
        sp: int) -> DSIRun:  # fmt: skip
    """Algorithm 1 with lookahead over `sp` target servers (see the module docstring)."""
    run = DSIRun()
    verified, now = 0, 0.0
    while verified < n:
        first_wrong = verified + 1
        while _right(correct, first_wrong):
            first_wrong += 1
        now, verified = _dsi_round(run, verified, now, first_wrong, n, _cost(target_s),
                                   drafter_s, lookahead, sp)  # fmt: skip
    run.latency, run.tokens = now, verified
    return run


def _dsi_round(run: DSIRun, start: int, t0: float, first_wrong: int, n: int,
               cost: Callable[[int], float], drafter_s: float, lookahead: int,
               sp: int) -> tuple[float, int]:  # fmt: skip
    """From a verified prefix of `start` tokens at time t0 until the rejection of the draft at
    `first_wrong` (or n tokens): (the time, the verified length)."""
    servers = [t0] * sp  # when each server is free
    heapq.heapify(servers)
    done: list[tuple[int, int, float]] = []  # finished tasks waiting for their turn: (lo, hi, t)
    finishing: list[tuple[float, int, int]] = []  # (finish time, lo, hi)

    def start_task(at: float, lo: int, hi: int) -> None:
        free = heapq.heappop(servers)
        begin = max(at, free)
        run.idle_waits += begin > at
        end = begin + cost(hi - lo + 1)  # the rows of positions lo..hi
        heapq.heappush(servers, end)
        heapq.heappush(finishing, (end, lo, hi))
        run.target_forwards += 1

    def drafted(at: float) -> int:  # last drafted position by time `at`
        return start + int((at - t0) / drafter_s + 1e-9)

    start_task(t0, start + 1, start + 1)  # the verified prefix alone: the next token
    block, verified = 1, start
    while True:
        block_end = t0 + block * lookahead * drafter_s
        if finishing and finishing[0][0] <= block_end:
            at, lo, hi = heapq.heappop(finishing)
            done.append((lo, hi, at))
        else:  # the drafter finishes a block: a task over it (and the position after it)
            lo = start + (block - 1) * lookahead + 1
            start_task(block_end, lo, start + block * lookahead + 1)
            block += 1
            continue
        # Verify with every finished task whose block reaches the verified position, in order.
        progressed = True
        while progressed:
            progressed = False
            for task in sorted(done):
                lo, hi, _ = task
                if lo > verified + 1:
                    continue
                done.remove(task)
                if hi <= verified:
                    run.wasted += 1
                    continue
                progressed = True
                if first_wrong <= hi:  # the target's token replaces the wrong draft
                    verified = first_wrong
                    run.rejections += verified < n
                    run.wasted += len(finishing) + len(done)  # the wrong path's tasks
                    return at, min(verified, n)
                verified = hi
                if verified >= n:
                    run.wasted += len(finishing)
                    return at, n
                break
        covered = any(lo <= verified + 1 <= hi for _, lo, hi in finishing)
        covered |= any(lo <= verified + 1 <= hi for lo, hi, _ in done)
        if not covered:  # nothing in flight reaches the next position: start it now
            start_task(at, verified + 1, max(verified, drafted(at)) + 1)


def expected_dsi(target_s: Latency, drafter_s: float, sp: int, acceptance: float,
                 tokens: int = 64, runs: int = 40, seed: int = 0) -> dict[int, float]:  # fmt: skip
    """DSI's expected seconds per token at each lookahead worth trying (common random numbers
    across them): 1 up to Equation 1's with one-row forwards, past which a block only grows."""
    cost = _cost(target_s)
    rng = random.Random(seed)
    draws = [draw_correct(tokens, min(max(acceptance, 0.0), 1.0), rng) for _ in range(runs)]
    return {k: statistics.mean(dsi(tokens, cost, drafter_s, c, k, sp).latency for c in draws)
            / tokens for k in range(1, min_lookahead(cost(1), drafter_s, sp) + 1)}  # fmt: skip


def best_lookahead(target_s: Latency, drafter_s: float, sp: int, acceptance: float,
                   tokens: int = 64, runs: int = 40, seed: int = 0) -> int:  # fmt: skip
    """The lookahead with the lowest expected DSI latency here (ties to the smaller). With a
    forward whose cost does not depend on its rows that is about Equation 1's; where every row
    costs, a shorter block can win."""
    expected = expected_dsi(target_s, drafter_s, sp, acceptance, tokens, runs, seed)
    return min(expected, key=expected.__getitem__)
