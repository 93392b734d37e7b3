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
"""

from __future__ import annotations

import os
import time
import warnings

from specinfer.dsi.orchestrator import Orchestrator
from specinfer.dsi.servers import ServerSpec, TargetPool
from specinfer.dsi.sim import (
    Latency,
    RowCost,
    best_lookahead,
    chain_acceptance,
    level_cost,
    level_width,
    min_lookahead,
)

MAX_LOOKAHEAD = 64
WARMUP = "The quick brown fox jumps over the lazy dog. The quick brown fox"
PRIOR_ACCEPTANCE = 0.5  # until drafts have been tested
RECHOOSE = 0.05  # choose the lookahead again when the acceptance rate moves this much
DRAFT_COUNTS = ("accepted", "accepted_main", "tested")  # a request's metrics: its acceptance


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
        self.pool = pool
        self.orchestrator = Orchestrator(pool, engine.drafter if drafter else None,
                                         lookahead or 1, overlap, draft_s)  # fmt: skip
        self.latencies: dict = {}
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
        m = seq.metrics["dsi"]
        self.drafter_s = m["draft_s"] / max(1, m["draft_calls"])
        self.tested = [m[k] for k in DRAFT_COUNTS]
        self.width = level_width(m["compute_rows"], m["compute_levels"], m["compute_n"])
        context, timed = seq.prompt_ids + seq.output_ids, {}

        def time_rows(rows: int) -> float:
            timed[rows] = min(self.pool.time_forward(context, rows) for _ in range(2))
            return timed[rows]

        servers = len(self.pool.alive)
        top = min(MAX_LOOKAHEAD, min_lookahead(time_rows(1), self.drafter_s, servers)) + 1
        rows = 2
        while rows < top:
            time_rows(rows)
            rows = 2 * rows - 1  # 2, 3, 5, 9, 17, ...
        time_rows(top)
        self.row_cost = RowCost(timed)
        self._choose()

    def _choose(self) -> None:
        acceptance = chain_acceptance(*self.tested) if self.tested[-1] else PRIOR_ACCEPTANCE
        servers = len(self.pool.alive)
        cost = level_cost(self.row_cost, self.width)
        self.orchestrator.lookahead = choose_lookahead(cost, self.drafter_s, servers, acceptance)
        self.latencies = {"target_s": self.row_cost(1), "drafter_s": self.drafter_s,
                          "row_cost": self.row_cost, "level_width": self.width,
                          "acceptance": acceptance}  # fmt: skip

    def _learn(self, m: dict) -> None:
        """Fold a finished request's drafts into the acceptance rate; choose again if it moved."""
        self.tested = [n + m[k] for n, k in zip(self.tested, DRAFT_COUNTS)]
        if abs(chain_acceptance(*self.tested) - self.latencies["acceptance"]) > RECHOOSE:
            self._choose()

    @property
    def lookahead(self) -> int:
        return self.orchestrator.lookahead

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

        def emit(tokens: list[int]) -> bool:
            if not seq.output_ids:
                seq.metrics["ttft_s"] = time.perf_counter() - start
            out = engine._append(seq, tokens)
            outputs.append(out)
            return out.finished

        try:
            m = self.orchestrator.run(seq, emit)
        finally:
            if not seq.finished:
                seq.finish_reason = seq.finish_reason or "abort"
                sched.finish(seq)
        seq.metrics["dsi"] = m
        if self.latencies and m["tested"]:
            self._learn(m)
        seq.metrics["steps"] = m["blocks_verified"]
        seq.metrics["ssm_s"] += m["draft_s"]
        seq.metrics["target_s"] += time.perf_counter() - start - m["draft_s"]
        return outputs

    def close(self) -> None:
        self.pool.close()


def choose_lookahead(target_s: Latency, drafter_s: float, servers: int, acceptance: float) -> int:
    """The lookahead DSI runs with: see the module doc (target_s: seconds per forward, or
    seconds by the positions it verifies)."""
    return min(MAX_LOOKAHEAD, best_lookahead(target_s, max(drafter_s, 1e-6), servers, acceptance))


def server_spec(engine, threads: int = 1, latency_s: float | None = None) -> ServerSpec:
    """Servers with copies of `engine`'s target (or, given latency_s, emulated ones), whose
    caches hold a request and the widest block its drafter can make."""
    per_level = max(1, engine.drafter.num_nodes - 1) if engine.drafter else 1
    capacity = engine.max_model_len + MAX_LOOKAHEAD * per_level + 1
    path = None if latency_s is not None else str(engine.model_path)
    return ServerSpec(path, engine.dtype, threads, capacity, latency_s or 0.0)
