"""DSI's target servers: processes that each hold a copy of the target and its own KV cache,
and verify the lookahead blocks the orchestrator (orchestrator.py) sends them, one at a time.

A task names a context (the verified prefix and the drafts its block hangs from) and a block:
drafted nodes below the context's last token, a tree (each node's parent is the context's last
token, -1, or an earlier node of the block). A server remembers the tokens its cache holds and
feeds only what differs (its KV is rolled back to the longest common prefix: a rejected path's
entries are overwritten later), the block in the same forward under a tree mask. It answers the
target's next-token rows at the context's last token and at every block node: the argmax for a
greedy request, the distribution (temperature, top-k, top-p applied) for a sampling one. It
then keeps the block's main chain (the nodes the task flags) in its cache: the next block's
context.

Preemption: the orchestrator raises a server's entry of a shared-memory tensor to the id of the
task to stop; the server checks it before every decoder layer and abandons the forward
(answering "preempted"), so a task on a wrong path holds its server for at most one layer.

Emulated servers (bench_dsi's latency sweep) replay a recorded greedy trace instead of running
the target: a row is the trace's next token where the row's path follows the trace (-1 past a
wrong draft, where verification never reads), after sleeping the emulated forward latency in
slices, checking for preemption.

Messages travel over one multiprocessing pipe per server, so the orchestrator waits on every
server and every server process's sentinel in one call: a server that dies is seen at once.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from specinfer import ops
from specinfer.distributed.workers import stop_processes
from specinfer.sampling import greedy_tokens, probabilities

LOAD_TIMEOUT = float(os.environ.get("SPECINFER_LOAD_TIMEOUT", "900"))  # seconds to load a copy


class DSIError(RuntimeError):
    """The target servers failed: none is left, one did not load, or one answered nonsense."""


class Preempted(Exception):
    pass


@dataclass
class ServerSpec:
    path: str | None  # the target checkpoint (None: emulated servers)
    dtype: torch.dtype
    threads: int
    capacity: int  # positions a server's cache holds (a request and its widest block)
    latency_s: float = 0.0  # emulated forward latency (emulated servers only)


@dataclass
class Task:
    id: int
    context: list[int]
    tokens: list[int] = field(default_factory=list)  # the block's nodes
    parents: list[int] = field(default_factory=list)  # -1: the context's last token
    main: list[int] = field(default_factory=list)  # block nodes of the main chain, in order
    sampling: tuple | None = None  # (temperature, top_k, top_p, min_p); None: greedy


@dataclass
class Result:
    server: int
    task: int
    status: str  # "done", "preempted" or "dead"
    rows: object = None  # list of argmax ids, or a float32 array [rows, vocab]
    compute_s: float = 0.0  # the server's time on the task
    why: str = ""  # a dead server's exit


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


def _depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


class _RealTarget:
    """The target and a one-row cache; preemptible between decoder layers."""

    def __init__(self, spec: ServerSpec):
        from specinfer.layers import pack_linears
        from specinfer.loader import load_model

        self.model = load_model(spec.path, dtype=spec.dtype, device="cpu")
        pack_linears(self.model)  # the kernels the engine's target runs, so the same bits
        self.kv = self.model.make_kv_cache(1, spec.capacity)
        self.cached: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.stopped = lambda: False
        for layer in self.model.decoder_layers():
            layer.register_forward_pre_hook(self._check)

    def _check(self, *_):
        if self.stopped():
            raise Preempted

    @torch.inference_mode()
    def run(self, task: Task) -> object:
        ctx = task.context
        keep = common_prefix(self.cached, ctx, len(ctx) - 1)  # the last token is fed: its row
        self.cached = self.cached[:keep]
        fed = len(ctx) - keep
        ids = ctx[keep:] + task.tokens
        positions = list(range(keep, len(ctx))) + [len(ctx) - 1 + d for d in _depths(task.parents)]
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        for j in range(len(task.parents)):  # a node sees the context and its ancestors
            row, node = fed + j, j
            mask[row, fed:] = False
            while node >= 0:
                mask[row, fed + node] = True
                node = task.parents[node]
        hidden = self.model(torch.tensor([ids]), torch.tensor([positions]), self.kv,
                            torch.tensor([0]), torch.tensor([keep]), mask[None])  # fmt: skip
        logits = self.model.compute_logits(hidden[0, fed - 1 :]).float()
        path = torch.tensor([[0] + [1 + j for j in task.main]])
        ops.kv_commit(self.kv.k + self.kv.v, torch.tensor([0]), torch.tensor([len(ctx) - 1]), path)
        self.cached = ctx + [task.tokens[j] for j in task.main]
        return _rows(logits, task.sampling)


class _TraceTarget:
    """A recorded greedy trace (prompt + the target's tokens) and a fixed forward latency."""

    def __init__(self, spec: ServerSpec):
        self.latency_s, self.trace, self.stopped = spec.latency_s, [], lambda: False

    def run(self, task: Task) -> list[int]:
        end = time.perf_counter() + self.latency_s
        while (left := end - time.perf_counter()) > 0:
            if self.stopped():
                raise Preempted
            time.sleep(min(left, 0.0005))
        ctx, trace = task.context, self.trace
        if task.sampling is not None:
            raise ValueError("emulated target servers replay greedy traces only")
        if ctx != trace[: len(ctx)]:
            return [-1] * (1 + len(task.tokens))
        paths = [[]]
        for token, parent in zip(task.tokens, task.parents):
            paths.append((paths[parent + 1] if parent >= 0 else []) + [token])
        rows = []
        for p in paths:
            n = len(ctx) + len(p)
            rows.append(trace[n] if n < len(trace) and trace[len(ctx) : n] == p else -1)
        return rows


def _rows(logits: torch.Tensor, sampling) -> object:
    if sampling is None:
        return greedy_tokens(logits).tolist()
    return probabilities(logits, *sampling).numpy()


def _serve(index: int, conn, cancel: torch.Tensor, spec: ServerSpec) -> None:
    """A server's life: load, say ready, run tasks until "stop" (or the pipe closes)."""
    try:
        torch.set_num_threads(spec.threads)
        target = _RealTarget(spec) if spec.path else _TraceTarget(spec)
        conn.send(("ready", None))
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "trace":
                target.trace = payload
                continue
            task: Task = payload
            target.stopped = lambda task_id=task.id: int(cancel[index]) >= task_id
            start = time.perf_counter()
            try:
                rows, status = target.run(task), "done"
            except Preempted:
                rows, status = None, "preempted"
            conn.send((status, (task.id, rows, time.perf_counter() - start)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1) from None


class TargetPool:
    """The orchestrator's side: SP server processes, their pipes and their cancel flags."""

    def __init__(self, spec: ServerSpec, size: int):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"target_servers must be an integer >= 1, got {size!r}")
        self.spec, self.size, self.closed = spec, size, False
        ctx = mp.get_context("spawn")
        self.cancel = torch.zeros(size, dtype=torch.int64).share_memory_()
        self.conns, self.procs = [], []
        atexit.register(self.close)
        for i in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(i, child, self.cancel, spec),
                            name=f"specinfer-dsi-server{i}", daemon=True)  # fmt: skip
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.alive = set(range(size))
        self.busy: dict[int, int] = {}  # server -> the id of the task it runs
        # Task ids rise over the pool's life (not per orchestrator): a server takes its
        # cancel flag, the highest id stopped, as covering every task up to it.
        self._ids = itertools.count(1)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT
        waiting = set(range(self.size))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DSIError(f"target servers {sorted(waiting)} did not load in {LOAD_TIMEOUT} s")
            for i in list(waiting):
                if self.conns[i].poll(min(left, 0.05)):
                    try:
                        kind, payload = self.conns[i].recv()
                    except EOFError:
                        self.procs[i].join(timeout=5)
                        code = self.procs[i].exitcode
                        raise DSIError(f"target server {i} exited while loading (code {code}); "
                                       "a script that starts one needs an "
                                       "`if __name__ == '__main__':` guard") from None  # fmt: skip
                    if kind != "ready":
                        raise DSIError(f"target server {i} failed to load:\n{payload}")
                    waiting.discard(i)
                elif not self.procs[i].is_alive():
                    raise DSIError(f"target server {i} exited with code {self.procs[i].exitcode}")

    def next_id(self) -> int:
        return next(self._ids)

    def free(self) -> list[int]:
        return sorted(self.alive - set(self.busy))

    def submit(self, server: int, task: Task) -> None:
        self.busy[server] = task.id
        self._send(server, ("task", task))

    def time_forward(self, context: list[int], rows: int) -> float:
        """A free server's seconds for a task of `rows` rows (the context's last token and a
        chain of rows - 1 nodes below it): calibration, as a CPU forward's cost grows with rows."""
        free = self.free()
        if not free:
            raise DSIError("no target server is free to time a forward")
        chain = [context[i % len(context)] for i in range(rows - 1)]
        task = Task(self.next_id(), context, chain, list(range(-1, rows - 2)))
        self.submit(free[0], task)
        deadline = time.monotonic() + LOAD_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            for r in self.poll(left)[0]:
                if r.task == task.id:
                    if r.status != "done":
                        raise DSIError(f"target server {r.server} {r.status} while timing a "
                                       f"forward {r.why.strip()[-300:]}")  # fmt: skip
                    return r.compute_s
        raise DSIError(f"no target server answered a timing task in {LOAD_TIMEOUT:.0f} s")

    def set_trace(self, trace: list[int]) -> None:
        for i in sorted(self.alive):
            self._send(i, ("trace", trace))

    def preempt(self, server: int) -> None:
        """Stop the server's task (it answers "preempted", or "done" if it had finished)."""
        if server in self.busy:
            self.cancel[server] = max(int(self.cancel[server]), self.busy[server])

    def _send(self, server: int, message) -> None:
        try:
            self.conns[server].send(message)
        except (BrokenPipeError, OSError):
            pass  # its death is reported by poll()

    def poll(self, timeout: float | None, wake=None) -> tuple[list[Result], bool]:
        """What the servers answered (or that one died) within `timeout` seconds, and whether
        `wake` (a socket another thread writes to) ended the wait."""
        live = sorted(self.alive)
        if not live:
            raise DSIError("every target server has died")
        by_handle = {self.conns[i]: i for i in live} | {self.procs[i].sentinel: i for i in live}
        out, woken = [], False
        for handle in wait(list(by_handle) + ([wake] if wake is not None else []), timeout):
            if handle is wake:
                wake.recv(4096)
                woken = True
                continue
            i = by_handle[handle]
            if i not in self.alive:
                continue
            try:
                if handle is self.conns[i] or self.conns[i].poll():
                    kind, payload = self.conns[i].recv()
                    if kind == "error":
                        raise EOFError(payload)
                    task, rows, seconds = payload
                    self.busy.pop(i, None)
                    out.append(Result(i, task, kind, rows, seconds))
                    continue
            except (EOFError, OSError) as e:
                why = str(e) or "its pipe closed"
            else:
                why = f"exited with code {self.procs[i].exitcode}"
            self.procs[i].join(timeout=1)
            self.alive.discard(i)
            out.append(Result(i, self.busy.pop(i, -1), "dead", why=why))
        return out, woken

    def close(self) -> None:
        """Stop every server: a stop message, then terminate, then kill."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        for i in range(len(self.conns)):
            self._send(i, ("stop", None))
        stop_processes(self.procs, grace=5)
        for c in self.conns:
            c.close()
