"""The Engine's DSI mode: its target server pool, the orchestrator, and the step that runs one
request through them (DSI overlaps drafting with verification inside one request, so requests
run one at a time; `stream` gets a request's text when it ends).

The lookahead, unless given, is chosen from measurements: a warm-up request gives the drafter's
latency per level and a first acceptance rate, and a server times its forward over 1, 2, 3, 5,
9, ... rows. Equation 1 (with a one-row forward) bounds the candidates: the smallest lookahead
that `target_servers` servers keep up with; below it the simulator (dsi/sim.py, fed the row
costs) picks the one with the lowest expected latency. On a GPU a forward costs about the same
for a few rows and the pick is near Equation 1's; on a CPU every row costs, and shorter blocks
win. The acceptance rate is updated as requests finish, and the lookahead chosen again when it
moves.

Where the servers and the drafter share cores (or memory bandwidth), a forward is slower while
the drafter runs (the drafting requests measure by how much: their forwards against the timed
ones). When the
simulator, so slowed, does not expect DSI at its best lookahead to save MIN_GAIN over decoding
without drafts, DSI decodes without them (the servers alone, a task per token) and `drafting` is
False: Theorem 1's "never slower than non-SI" kept where its assumption, a core for each, does
not hold. Every PROBE_EVERY-th request then drafts anyway, so the acceptance rate and the
slowdown keep being measured and the choice is made again. A given lookahead always drafts.
"""

from __future__ import annotations

import math
import os
import time
import warnings

from specinfer.dsi.orchestrator import Orchestrator
from specinfer.dsi.servers import ServerSpec, TargetPool
from specinfer.dsi.sim import (
    Latency,
    RowCost,
    chain_acceptance,
    expected_dsi,
    level_cost,
    level_width,
    min_lookahead,
)

MAX_LOOKAHEAD = 64
WARMUP = "The quick brown fox jumps over the lazy dog. The quick brown fox"
PRIOR_ACCEPTANCE = 0.5  # until drafts have been tested
RECHOOSE = 0.05  # choose the lookahead again when the acceptance rate moves this much
# Drafting must be expected to save this share of a token's time: what the simulator leaves out
# (the drafter thread beside the orchestrator, more messages, preempted tasks) cost DSI 1-2%
# against non-SI in bench_dsi's runs where neither gains.
MIN_GAIN = 0.03
TIMINGS = 3  # a forward's cost is the best of this many timings
PROBE_EVERY = 8  # while not drafting, every 8th request drafts, to learn if it pays by now
# A drafting request's metrics the choice is made from: acceptance, drafter and forward times.
LEARNED = ("accepted", "accepted_main", "tested", "draft_s", "draft_calls", "compute_s",
           "compute_n", "compute_rows", "compute_levels")  # fmt: skip


class DSIMode:
    def __init__(self, engine, pool: TargetPool, lookahead: int | None = None,
                 overlap: bool = True, drafter: bool = True, draft_s: float | None = None):  # fmt: skip
        """DSI for `engine`'s requests over `pool` (SI with overlap=False, non-SI without the
        drafter: the baselines, through the same servers). draft_s: an emulated drafter
        latency (see Orchestrator)."""
        if lookahead is not None and (
            not isinstance(lookahead, int) or isinstance(lookahead, bool)
            or not 1 <= lookahead <= MAX_LOOKAHEAD
        ):  # fmt: skip
            raise ValueError(
                f"lookahead must be an integer in [1, {MAX_LOOKAHEAD}], got {lookahead!r}"
            )
        self.pool, self.drafter = pool, engine.drafter if drafter else None
        self.orchestrator = Orchestrator(pool, self.drafter, lookahead or 1, overlap, draft_s)
        self.latencies: dict = {}
        self.requests = 0
        if lookahead is None and drafter:
            self.calibrate(engine)

    @classmethod
    def start(cls, engine, target_servers: int, lookahead: int | None, threads: int = 1):
        """The Engine's mode "dsi": `target_servers` copies of its target."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if engine.device.type == "cpu" and cores and target_servers * threads + 1 > cores:
            warnings.warn(
                f"DSI with {target_servers} target server(s) of {threads} thread(s) and a drafter "
                f"needs {target_servers * threads + 1} cores; this machine has {cores}. They will "
                "share cores, and DSI can then be slower than plain decoding",
                stacklevel=3,
            )
        pool = TargetPool(server_spec(engine, threads), target_servers)
        try:
            return cls(engine, pool, lookahead)
        except BaseException:
            pool.close()
            raise

    def calibrate(self, engine) -> None:
        """Time a short warm-up request (lookahead 1) and a server's forward over growing
        blocks; choose the lookahead."""
        from specinfer.sampling import SamplingParams

        seq = engine.make_sequence(WARMUP, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.add_sequence(seq)
        self.step(engine)
        self.seen = seen = {k: seq.metrics["dsi"][k] for k in LEARNED}
        drafter_s = seen["draft_s"] / max(1, seen["draft_calls"])
        width = level_width(seen["compute_rows"], seen["compute_levels"], seen["compute_n"])
        self.row_cost = time_row_costs(self.pool, seq.prompt_ids + seq.output_ids, drafter_s,
                                       [len(self.pool.alive)], width)  # fmt: skip
        self._choose()

    def _choose(self) -> None:
        """Choose from everything the drafting requests measured (self.seen)."""
        seen = self.seen
        tested = [seen[k] for k in ("accepted", "accepted_main", "tested")]
        acceptance = chain_acceptance(*tested) if seen["tested"] else PRIOR_ACCEPTANCE
        drafter_s = seen["draft_s"] / max(1, seen["draft_calls"])
        width = level_width(seen["compute_rows"], seen["compute_levels"], seen["compute_n"])
        contention = 1.0
        if seen["compute_n"]:  # their forwards against the timed ones of as many rows
            forward = seen["compute_s"] / seen["compute_n"]
            contention = max(1.0, forward / self.row_cost(seen["compute_rows"] / seen["compute_n"]))
        cost = level_cost(self.row_cost, width)
        self.best, pays = plan_lookahead(cost, drafter_s, len(self.pool.alive), acceptance,
                                         contention)  # fmt: skip
        self.orchestrator.lookahead = self.best if pays else 1
        self.orchestrator.drafter = self.drafter if pays else None
        self.latencies = {"target_s": self.row_cost(1), "drafter_s": drafter_s,
                          "row_cost": self.row_cost, "level_width": width,
                          "acceptance": acceptance, "contention": contention}  # fmt: skip

    def _learn(self, m: dict) -> None:
        """Fold a drafting request's measurements in; choose again when the acceptance rate
        moved, or after a probe."""
        before = self.latencies["acceptance"]
        self.seen = {k: v + m[k] for k, v in self.seen.items()}
        tested = [self.seen[k] for k in ("accepted", "accepted_main", "tested")]
        if not self.drafting or abs(chain_acceptance(*tested) - before) > RECHOOSE:
            self._choose()

    @property
    def lookahead(self) -> int:
        return self.orchestrator.lookahead

    @property
    def drafting(self) -> bool:
        return self.orchestrator.drafter is not None

    def step(self, engine) -> list:
        """Run the oldest waiting request to its end; what it produced."""
        sched = engine.scheduler
        if not sched.waiting:
            return []
        seq = sched.waiting[0]
        if not engine.kv.allocate(seq, len(seq.prompt_ids) + 1):  # its drafter row
            raise RuntimeError("DSI: no drafter row is free")
        sched.waiting.popleft()
        sched.running.append(seq)
        outputs, start = [], time.perf_counter()
        self.requests += 1
        probe = self.latencies and not self.drafting and self.requests % PROBE_EVERY == 0
        if probe:  # draft on this one, to learn whether drafting pays by now
            self.orchestrator.drafter, self.orchestrator.lookahead = self.drafter, self.best

        def emit(tokens: list[int]) -> bool:
            if not seq.output_ids:
                seq.metrics["ttft_s"] = time.perf_counter() - start
            out = engine._append(seq, tokens)
            outputs.append(out)
            return out.finished

        try:
            m = self.orchestrator.run(seq, emit)
        finally:
            if probe:
                self.orchestrator.drafter, self.orchestrator.lookahead = None, 1
            if not seq.finished:
                seq.finish_reason = seq.finish_reason or "abort"
                sched.finish(seq)
        seq.metrics["dsi"] = m
        if self.latencies and m["draft_calls"]:
            self._learn(m)
        seq.metrics["steps"] = m["blocks_verified"]
        seq.metrics["ssm_s"] += m["draft_s"]
        seq.metrics["target_s"] += time.perf_counter() - start - m["draft_s"]
        return outputs

    def close(self) -> None:
        self.pool.close()


def time_row_costs(pool: TargetPool, context: list[int], drafter_s: float, servers: list[int],
                   width: float = 1.0) -> RowCost:  # fmt: skip
    """A server's forward after `context` over 1, 2, 3, 5, 9, ... rows (the best of TIMINGS:
    this machine's noise is one-sided), up to a block of Equation 1's lookahead with the most of
    `servers` (one-row forwards) and `width` drafted nodes a level."""

    def best(rows: int) -> float:
        return min(pool.time_forward(context, rows) for _ in range(TIMINGS))

    timed = {1: best(1)}
    lookahead = min(MAX_LOOKAHEAD, max(min_lookahead(timed[1], drafter_s, n) for n in servers))
    top, rows = 1 + math.ceil(width * lookahead), 2
    while rows < top:
        timed[rows] = best(rows)
        rows = 2 * rows - 1  # 2, 3, 5, 9, 17, ...
    timed[top] = best(top)
    return RowCost(timed)


def plan_lookahead(target_s: Latency, drafter_s: float, servers: int, acceptance: float,
                   contention: float = 1.0) -> tuple[int, bool]:  # fmt: skip
    """The lookahead with the lowest expected latency, and whether drafting at it is expected
    to pay (see the module doc; target_s: seconds per forward, or seconds by the positions it
    verifies; contention: how much slower a forward is while the drafter runs beside it)."""
    alone = target_s if callable(target_s) else lambda positions: target_s
    expected = expected_dsi(lambda positions: contention * alone(positions),
                            max(drafter_s, 1e-6), servers, acceptance)  # fmt: skip
    best = min(expected, key=expected.__getitem__)
    return min(MAX_LOOKAHEAD, best), expected[best] < (1 - MIN_GAIN) * alone(1)


def choose_lookahead(target_s: Latency, drafter_s: float, servers: int, acceptance: float,
                     contention: float = 1.0) -> int | None:  # fmt: skip
    """The lookahead DSI runs with, or None where drafting does not pay (plan_lookahead)."""
    lookahead, pays = plan_lookahead(target_s, drafter_s, servers, acceptance, contention)
    return lookahead if pays else None


def server_spec(engine, threads: int = 1, latency_s: float | None = None) -> ServerSpec:
    """Servers with copies of `engine`'s target (or, given latency_s, emulated ones), whose
    caches hold a request and the widest block its drafter can make."""
    per_level = max(1, engine.drafter.num_nodes - 1) if engine.drafter else 1
    capacity = engine.max_model_len + MAX_LOOKAHEAD * per_level + 1
    path = None if latency_s is not None else str(engine.model_path)
    return ServerSpec(path, engine.dtype, threads, capacity, latency_s or 0.0)
