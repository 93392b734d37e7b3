"""The Engine's DSI mode: its target server pool, the orchestrator, and the step that runs one
request through them (DSI overlaps drafting with verification inside one request, so requests
run one at a time; `stream` gets a request's text when it ends).

The lookahead, unless given, comes from Equation 1 and latencies measured on a warm-up request
(the target's forward on a server, the drafter's level): the smallest that `target_servers`
servers keep up with.
"""

from __future__ import annotations

import time

from specinfer.dsi.orchestrator import Orchestrator, choose_lookahead
from specinfer.dsi.servers import ServerSpec, TargetPool

MAX_LOOKAHEAD = 64
WARMUP = "The quick brown fox jumps over the lazy dog. The quick brown fox"


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
        self.latencies: dict[str, float] = {}
        if lookahead is None and drafter:
            self.calibrate(engine)

    @classmethod
    def start(cls, engine, target_servers: int, lookahead: int | None, threads: int = 1):
        """The Engine's mode "dsi": `target_servers` copies of its target."""
        pool = TargetPool(server_spec(engine, threads), target_servers)
        try:
            return cls(engine, pool, lookahead)
        except BaseException:
            pool.close()
            raise

    def calibrate(self, engine) -> None:
        """Time a short warm-up request (lookahead 1) and set the lookahead by Equation 1."""
        from specinfer.sampling import SamplingParams

        seq = engine.make_sequence(WARMUP, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.add_sequence(seq)
        self.step(engine)
        m = seq.metrics["dsi"]
        target_s = m["compute_s"] / max(1, m["compute_n"])
        drafter_s = m["draft_s"] / max(1, m["draft_calls"])
        servers = len(self.pool.alive)
        self.orchestrator.lookahead = min(
            MAX_LOOKAHEAD, choose_lookahead(target_s, drafter_s, servers)
        )
        self.latencies = {"target_s": target_s, "drafter_s": drafter_s}

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
        seq.metrics["steps"] = m["blocks_verified"]
        seq.metrics["ssm_s"] += m["draft_s"]
        seq.metrics["target_s"] += time.perf_counter() - start - m["draft_s"]
        return outputs

    def close(self) -> None:
        self.pool.close()


def server_spec(engine, threads: int = 1, latency_s: float | None = None) -> ServerSpec:
    """Servers with copies of `engine`'s target (or, given latency_s, emulated ones), whose
    caches hold a request and the widest block its drafter can make."""
    per_level = max(1, engine.drafter.num_nodes - 1) if engine.drafter else 1
    capacity = engine.max_model_len + MAX_LOOKAHEAD * per_level + 1
    path = None if latency_s is not None else str(engine.model_path)
    return ServerSpec(path, engine.dtype, threads, capacity, latency_s or 0.0)
