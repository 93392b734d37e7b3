"""DSI's orchestrator: Algorithm 1 with a lookahead, over a pool of target servers, one request
at a time (the structure dsi/sim.py simulates, so its predictions compare with these runs).

A round starts from the verified tokens S: a tree rooted at S's last token, whose main chain the
drafter extends one level per drafter forward (each level: the merged proposals of every SSM
under the main chain's newest node; the main child is the first drafter's best). Target tasks:
- at once, one on S alone (its row gives the next token: the target never waits for the drafter;
  a request's first one goes to every server, which all need the prompt in their caches);
- after every `lookahead` levels, one over that block (its nodes, hung from the main node above
  it), sent to a free server while the drafter drafts on (queued when none is free);
- when nothing in flight covers the verified frontier, one there at once, over what is drafted
  below it.
Each task answers the target's rows at its hang node and its block's nodes. Verification walks
the tree from the frontier while rows are there: at node u, the target's row verifies u's
children (VerifyGreedy, or one step of multi-step speculative sampling over them: lossless); an
accepted child becomes the frontier and its token is emitted. When none is accepted, the
target's token is emitted, every task of the round is preempted (its server stops within a
layer), the drafter rolls back to the longest prefix it shares with the new S, and the next
round starts from it. The verified prefix only grows; a row is read only on the verified path.

`overlap=False` gives SI through the same servers (draft a block, verify it, repeat) and no
drafter gives non-SI (a task per token), so the three compare on equal terms.

A server that dies mid-run is dropped: the pool continues with fewer servers (its task is lost;
the frontier's coverage reissues what is needed); a DSIError when none is left.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from specinfer import verify
from specinfer.dsi.servers import DSIError, TargetPool, Task, common_prefix
from specinfer.sampling import draw_seed, make_generator
from specinfer.tree import TokenTree

ANSWER_TIMEOUT = 300.0  # seconds without any server answering before the run is an error


@dataclass
class _Job:
    task: Task
    round: int
    hang: int  # the round-tree node whose row comes first
    nodes: list[int]  # the round-tree nodes of its block
    server: int = -1
    sent: float = 0.0
    cancelled: float = 0.0
    prefill: bool = False  # a server's first task of the request: never preempted
    levels: int = 0  # the depths its block spans


def _metrics() -> dict:
    counts = ("rounds", "draft_calls", "drafted", "tested", "accepted", "accepted_main",
              "target_forwards", "blocks_verified", "wasted_forwards", "prefills", "preemptions", "servers_lost",
              "compute_n", "compute_rows", "compute_levels")  # fmt: skip
    seconds = ("drafter_idle_s", "target_idle_s", "message_s", "preempt_wait_s", "draft_s",
               "compute_s")  # fmt: skip
    return dict.fromkeys(counts, 0) | dict.fromkeys(seconds, 0.0)


class Orchestrator:
    def __init__(self, pool: TargetPool, drafter=None, lookahead: int = 1, overlap: bool = True,
                 draft_s: float | None = None):  # fmt: skip
        """draft_s: pad every drafter forward to this many seconds (emulated drafter latency:
        bench_dsi's sweep); results are handled while it waits."""
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 1:
            raise ValueError(f"lookahead must be an integer >= 1, got {lookahead!r}")
        self.pool, self.drafter, self.lookahead = pool, drafter, lookahead
        self.overlap, self.draft_s = overlap, draft_s

    # -- a request --------------------------------------------------------------------------------

    def run(self, seq, emit) -> dict:
        """Generate for `seq` (an engine Sequence holding a drafter row) until `emit(tokens)`
        returns True (it appends them and says whether the request finished); its metrics.

        Two threads: this one handles the servers' answers, verifies and covers the frontier;
        the drafter's drafts levels (torch releases the GIL in its forwards), so an answer is
        handled while the drafter computes. They share the round's state under one lock."""
        if seq.penalties.active:
            raise ValueError("DSI does not support repetition, presence or frequency penalties "
                             "or a logit bias")  # fmt: skip
        self.seq, self.emit, self.done, self.error = seq, emit, False, None
        self.m, self.jobs, self.queue = _metrics(), {}, deque()
        self.round, self.used = 0, set()
        self.lock = threading.Condition()
        self.wake, self._waker = socket.socketpair()  # the drafter wakes the serving thread
        now = time.perf_counter()
        self.idle_since = {i: now for i in self.pool.alive}
        # The drafter thread samples with the request's generator; verification gets its own,
        # split from it before that thread starts, so no generator is shared by two threads.
        self.verify_generator = make_generator(draw_seed(seq.generator), seq.generator.device)
        tokens = seq.prompt_ids + seq.output_ids
        self.fed: list[int] = []  # what the drafter has consumed
        if self.drafter:
            self.drafter.prefill([seq], [tokens[:-1]])
            self.fed = tokens[:-1]
        drafting = threading.Thread(target=self._drafter_loop, name="specinfer-dsi-drafter",
                                    daemon=True)  # fmt: skip
        with self.lock:
            self._new_round(tokens, prefill=True)
            for _ in self.pool.free():  # every server needs the prompt: prefill them all now
                self._issue(0, [], prefill=True)
        if self.drafter:
            drafting.start()
        try:
            with self.lock:
                self._serve()
        finally:
            with self.lock:
                self.done = True
                self.lock.notify_all()
            if drafting.is_alive():
                drafting.join(timeout=ANSWER_TIMEOUT)
            with self.lock:
                self._finish()
            self.wake.close()
            self._waker.close()
        return self.m

    def _serve(self) -> None:
        """This thread's loop (the lock held but while waiting for the servers)."""
        waited = 0.0
        while not self.done:
            self._verify()
            if self.done or self.error is not None:
                break
            self._cover()
            self.lock.notify_all()  # the frontier moved, or a round began: the drafter may go on
            self.lock.release()
            try:
                start = time.perf_counter()
                results, woken = self.pool.poll(ANSWER_TIMEOUT, wake=self.wake)
                waited = 0.0 if results or woken else waited + time.perf_counter() - start
            finally:
                self.lock.acquire()
            if waited >= ANSWER_TIMEOUT:
                raise DSIError(f"no target server answered for {ANSWER_TIMEOUT:.0f} s")
            self._take(results)
        if self.error is not None:
            raise self.error

    def _drafter_loop(self) -> None:
        try:
            while True:
                with self.lock:
                    start = time.perf_counter()
                    while not self.done and not self._can_draft():
                        self.lock.wait()
                    self.m["drafter_idle_s"] += time.perf_counter() - start
                    if self.done:
                        return
                    round_ = self.round
                    context = self.S + self.tree.path_tokens(self.main[1:])
                level = self._draft(context)
                with self.lock:
                    if not self.done and self.round == round_:
                        self._add_level(level)
                    self._wake()
        except BaseException as e:  # handed to the serving thread, which raises it
            with self.lock:
                self.error, self.done = e, True
                self._wake()

    def _new_round(self, tokens: list[int], prefill: bool = False) -> None:
        self.S, self.tree, self.main, self.frontier = tokens, TokenTree(tokens[-1]), [0], 0
        self.rows: dict[int, object] = {}
        self.row_job: dict[int, int] = {}
        self.block: list[int] = []  # drafted nodes no task covers yet
        self.block_hang = 0
        self.stalled = False  # the drafter proposed nothing under the main chain's end
        self.round += 1
        self.m["rounds"] += 1
        for job in self.jobs.values():  # every task of the old round is on a wrong path
            if job.server >= 0 and not job.cancelled and not job.prefill:
                self.pool.preempt(job.server)
                job.cancelled = time.perf_counter()
                self.m["preemptions"] += 1
        self.queue.clear()
        if self.overlap or not self.drafter or prefill:
            self._issue(0, [], prefill=prefill)

    # -- drafting ---------------------------------------------------------------------------------

    def _can_draft(self) -> bool:
        if not self.drafter or self.stalled:
            return False
        levels = len(self.main) - 1
        if len(self.S) + levels >= self.seq.max_len:  # nothing past the request's last token
            return False
        if not self.overlap:  # SI: a block, then its verification
            return levels < self.lookahead and not self._round_jobs()
        ahead = levels - self.tree.depths[self.frontier]
        return ahead < self.lookahead * (len(self.pool.alive) + 1)

    def _draft(self, context: list[int]) -> TokenTree:
        """One drafter forward (the drafter thread's, outside the lock): the merged proposals
        under the context's last token. The drafter first forgets what a rejection left."""
        start = time.perf_counter()
        keep = common_prefix(self.fed, context, len(context) - 1)
        if keep < len(self.fed):
            self.drafter.rollback(self.seq.row, keep)
            self.fed = self.fed[:keep]
        (t,) = self.drafter.draft([self.seq], [context], [[1] for _ in self.drafter.ssms])
        self.m["draft_calls"] += 1
        self.drafter.commit([self.seq], [len(context) - 1], [[0, 1] if len(t) > 1 else [0]])
        self.fed = context
        if self.draft_s is not None:  # an emulated drafter: the rest of its latency
            time.sleep(max(0.0, start + self.draft_s - time.perf_counter()))
        self.m["draft_s"] += time.perf_counter() - start
        return t

    def _add_level(self, t: TokenTree) -> None:
        """Hang a drafted level under the main chain's end; a block task every lookahead
        levels (SI: the block once drafted)."""
        if len(t) == 1:
            self.stalled = True
            self._cover()
            return
        parent, new = self.main[-1], {}
        for child, q, source in zip(t.prop_child, t.prop_q, t.prop_source):
            row = -1 if q < 0 else self.tree.add_distribution(t.q_rows[q])
            new[child] = self.tree.propose(parent, t.tokens[child], row, source)
        self.main.append(new[1])
        self.block += sorted(set(new.values()))
        self.m["drafted"] += 1
        depth = self.tree.depths[self.main[-1]]
        if self.overlap and depth - self.tree.depths[self.block_hang] == self.lookahead:
            self._issue(self.block_hang, self.block)
            self.block, self.block_hang = [], self.main[-1]
        self._cover()

    def _wake(self) -> None:
        """Wake the serving thread from its wait on the servers."""
        self.lock.notify_all()
        try:
            self._waker.send(b"x")
        except OSError:
            pass

    # -- target tasks -----------------------------------------------------------------------------

    def _round_jobs(self) -> list[_Job]:
        return [j for j in self.jobs.values() if j.round == self.round and not j.cancelled]

    def _cover(self) -> None:
        """Start a task at the frontier when none in flight will give its row."""
        f = self.frontier
        if f in self.rows or any(f == j.hang or f in j.nodes for j in self._round_jobs()):
            return
        if not self.overlap and self._can_draft():
            return  # SI: the block is not drafted yet
        below = [n for n in self.block if n != f and _descends(self.tree, n, f)]
        self._issue(f, below)
        self.block, self.block_hang = [], self.main[-1]

    def _issue(self, hang: int, nodes: list[int], prefill: bool = False) -> None:
        path = _path(self.tree, hang)
        main = set(self.main) if hang in self.main else set()
        index = {n: i for i, n in enumerate(nodes)}
        p = self.seq.params
        task = Task(id=self.pool.next_id(), context=self.S + self.tree.path_tokens(path[1:]),
                    tokens=[self.tree.tokens[n] for n in nodes],
                    parents=[index.get(self.tree.parents[n], -1) for n in nodes],
                    main=[i for i, n in enumerate(nodes) if n in main],
                    sampling=None if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p))  # fmt: skip
        assert all(self.tree.parents[n] in index or self.tree.parents[n] == hang for n in nodes)
        levels = len({self.tree.depths[n] for n in nodes})
        self.jobs[task.id] = _Job(task, self.round, hang, list(nodes), prefill=prefill,
                                  levels=levels)  # fmt: skip
        self.m["prefills"] += prefill
        self.queue.append(task.id)
        self._dispatch()

    def _dispatch(self) -> None:
        now = time.perf_counter()
        for server in self.pool.free():
            if not self.queue:
                return
            job = self.jobs[self.queue.popleft()]
            job.server, job.sent = server, now
            self.m["target_idle_s"] += now - self.idle_since.get(server, now)
            self.pool.submit(server, job.task)

    def _take(self, results: list) -> None:
        """The servers' answers: rows for the round's nodes; free servers get queued tasks."""
        now = time.perf_counter()
        for r in results:
            self.idle_since[r.server] = now
            job = self.jobs.pop(r.task, None)
            if r.status == "dead":
                warnings.warn(f"DSI target server {r.server} died ({r.why.strip()[-300:]}); "
                              f"continuing with {len(self.pool.alive)}", stacklevel=2)  # fmt: skip
                self.m["servers_lost"] += 1
                self.idle_since.pop(r.server, None)
                continue
            if job is None:
                continue  # a previous request's task, stopped when it ended
            self.m["target_forwards"] += 1
            self.m["message_s"] += max(0.0, now - job.sent - r.compute_s)
            if r.status == "done" and not job.prefill:
                self.m["compute_s"] += r.compute_s
                self.m["compute_n"] += 1
                self.m["compute_rows"] += 1 + len(job.nodes)
                self.m["compute_levels"] += job.levels
            if r.status == "preempted" or job.round != self.round:  # wasted: see _finish
                if job.cancelled:
                    self.m["preempt_wait_s"] += now - job.cancelled
                continue
            rows = list(r.rows)
            for node, row in zip([job.hang] + job.nodes, rows):
                if node not in self.rows:
                    self.rows[node], self.row_job[node] = row, r.task
        self._dispatch()

    # -- verification -----------------------------------------------------------------------------

    def _verify(self) -> None:
        while not self.done and self.frontier in self.rows:
            f = self.frontier
            self.used.add(self.row_job[f])
            child, token = self._step(f, self.rows[f])
            self.m["tested"] += bool(self.tree.children[f])
            if child is not None:
                self.frontier = child
                self.m["accepted"] += 1
                self.m["accepted_main"] += child in self.main  # else the block ends below it
            self.done = self.emit([token])
            if child is None and not self.done:
                self._new_round(self.S + self.tree.path_tokens(_path(self.tree, f)[1:]) + [token])

    def _step(self, f: int, row) -> tuple[int | None, int]:
        """Verify node f's children with the target's row at f: (the accepted child or None,
        the token emitted)."""
        tree = self.tree
        if self.seq.params.greedy:
            if int(row) < 0:
                raise DSIError("an emulated target server's trace has no token at the frontier")
            child = tree.children[f].get(int(row))
            return child, int(row)
        kids = sorted(tree.children[f].values())
        local = {c: i + 1 for i, c in enumerate(kids)}
        props = [(c, q) for p, c, q in zip(tree.prop_parent, tree.prop_child, tree.prop_q)
                 if p == f]  # fmt: skip
        p = torch.from_numpy(np.ascontiguousarray(row))
        probs = p.expand(len(kids) + 1, -1).contiguous()  # children's rows are never read here
        q = torch.stack(tree.q_rows) if tree.q_rows else None
        seed = draw_seed(self.verify_generator)
        path, token = verify.verify_stochastic(
            [-1] + [0] * len(kids), [tree.tokens[f]] + [tree.tokens[c] for c in kids], probs,
            ([0] * len(props), [local[c] for c, _ in props], [q for _, q in props]), q, seed)  # fmt: skip
        if len(path) > 1:
            child = kids[path[1] - 1]
            return child, tree.tokens[child]
        return None, token

    def _finish(self) -> None:
        """Stop what still runs and wait (bounded) for the servers' answers, so the next
        request finds them free; count the tasks whose rows were never read."""
        for job in self.jobs.values():
            if job.server >= 0 and not job.cancelled:
                self.pool.preempt(job.server)
                job.cancelled = time.perf_counter()
        self.round += 1  # whatever answers now is wasted
        deadline = time.perf_counter() + 30
        while self.pool.busy and time.perf_counter() < deadline and self.pool.alive:
            self._take(self.pool.poll(0.5)[0])
        now = time.perf_counter()
        for server in self.pool.free():
            self.m["target_idle_s"] += now - self.idle_since.get(server, now)
        self.m["blocks_verified"] = len(self.used)
        # The extra prefills (a request's first task on every server) are not waste.
        extra = max(0, min(self.m["prefills"], len(self.pool.alive)) - 1)
        self.m["wasted_forwards"] = max(0, self.m["target_forwards"] - len(self.used) - extra)


def _path(tree: TokenTree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def _descends(tree: TokenTree, node: int, ancestor: int) -> bool:
    while node > ancestor:
        node = tree.parents[node]
    return node == ancestor
