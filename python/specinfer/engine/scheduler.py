"""Which sequences run in the next step: admission, chunked prefill, finishing and aborts.

Each step decodes every running sequence whose prompt is cached, and spends what is left of the
step's token budget (`max_tokens_per_step`, one token per decoding sequence) on prompts: first
those already being prefilled, oldest first, then waiting requests in arrival order, each as soon
as a row and KV blocks for its prompt are free. A long prompt is prefilled in chunks over
several steps, so it never stalls the others' decoding for more than one chunk.

Each decoding sequence first gets KV blocks for the step's tokens (its newest token and a tree of
up to `lookahead` nodes). When the pool is short, the most recently admitted other sequence is
preempted: its blocks and row go back, and it waits at the head of the queue to be prefilled
again, prompt and output, when there is room (vLLM's recompute preemption). Its output so far
is kept, so what it streams is unchanged.

With prefix caching, a request's prefill starts after the blocks of its first tokens found in the
cache (kv_manager.py); each step first hands the cache the blocks the running sequences have
filled since the last. A waiting request whose next uncached block another request is prefilling
waits for it (a step or a chunk), instead of prefilling the same tokens beside it: n choices of
one prompt, or a burst of requests sharing a system prompt, prefill it once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specinfer.engine.kv_manager import KVManager
from specinfer.engine.sequence import Sequence, Status


@dataclass
class Plan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens now)
    admitted: list[Sequence] = field(default_factory=list)  # given a row this step


class Scheduler:
    def __init__(self, kv: KVManager, max_tokens_per_step: int, lookahead: int = 1):
        self.kv = kv
        self.max_tokens_per_step = max_tokens_per_step
        self.lookahead = lookahead  # positions a decode step may write: the widest tree
        self.preemptions = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}  # every waiting or running sequence

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        for seq in self.running:
            self.kv.cache_computed(seq)
        for seq in [s for s in self.running if s.prefilled]:  # oldest first
            while seq in self.running and not self.kv.reserve(
                seq, seq.num_tokens - 1 + self.lookahead
            ):
                self._preempt(self.running[-1])  # the newest, which may be seq itself
        plan = Plan(decode=[s for s in self.running if s.prefilled])
        budget = max(1, self.max_tokens_per_step - len(plan.decode))
        for seq in self.running:
            if not seq.prefilled and budget > 0:
                n = min(budget, seq.prefill_len - seq.num_computed)
                plan.prefill.append((seq, n))
                budget -= n
        prefilling = self.kv.prefilling([s for s in self.running if not s.prefilled])
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.kv.awaits(seq, prefilling):
                break  # in arrival order: those behind it wait too
            if not self.kv.allocate(seq, seq.prefill_len + self.lookahead):
                break
            prefilling |= self.kv.prefilling([seq])
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
            n = min(budget, seq.prefill_len - seq.num_computed)
            plan.prefill.append((seq, n))
            budget -= n
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.prefill_len = seq.num_tokens - 1  # all but its newest token, which decoding feeds
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (finished or aborted): its rows go back at once."""
        seq.status = Status.FINISHED
        self.kv.free(seq)
        if self._by_id.get(seq.request_id) is seq:
            del self._by_id[seq.request_id]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)
