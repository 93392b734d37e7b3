"""Worker processes (tensor- and pipeline-parallel ranks): rank 0's handle on them (`Workers`)
and their loop.

Rank 0 (the process that builds the Engine) spawns ranks 1..N-1, or, under torchrun, finds them
already started. Each worker loads its shard of the target (its stage's layers, its TP slice of
them), then runs rank 0's ModelRunner calls as they come (`ModelRunner._call`) until told to
stop. A worker that dies or fails is reported on
rank 0 by name, exit code and traceback: its collectives fail at once (a dead peer closes its
sockets) or after the step deadline (a hung one), and `Workers.call` names the cause. `close`
stops them all (atexit too): a stop message, then terminate, then kill.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specinfer.distributed.group import Parallel, connect, tensor_parallel

STEP_TIMEOUT = float(os.environ.get("SPECINFER_STEP_TIMEOUT", "30"))  # seconds a collective waits
LOAD_TIMEOUT = 900.0  # seconds rank 0 waits for the workers' shards to load


@dataclass
class ShardSpec:
    """What a worker needs to build its shard of the target."""

    path: str
    dtype: torch.dtype
    device: str  # "cpu", or "cuda" (rank r uses cuda:r)
    threads: int
    tp: int  # ranks per stage
    pp: int  # pipeline stages

    @property
    def world(self) -> int:
        return self.tp * self.pp


class WorkerError(RuntimeError):
    """A worker (a tensor- or pipeline-parallel rank) died, failed or stopped answering."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


def build_shard(spec: ShardSpec, par: Parallel):
    from specinfer.loader import load_model

    with tensor_parallel(par.tp, par.stage, par.pp):
        return load_model(spec.path, dtype=spec.dtype, device=rank_device(spec.device, par.rank))


class Workers:
    """Rank 0's side: the group, the worker processes (spawned ones), and calls to them."""

    def __init__(self, spec: ShardSpec, torchrun: bool = False):
        size = spec.world
        self.size, self.failure, self.group, self.closed = size, None, None, False
        self.procs: list = []
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()  # (rank, traceback) from a spawned worker that failed
        if torchrun:  # the other ranks were started by torchrun and call run_worker()
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
        else:
            host, port = "127.0.0.1", free_port()
            for rank in range(1, size):
                p = ctx.Process(target=_spawned_worker, name=f"specinfer-rank{rank}",
                                args=(rank, host, port, spec, self.errors), daemon=True)  # fmt: skip
                p.start()
                self.procs.append(p)
        atexit.register(self.close)
        self._stop = threading.Event()
        threading.Thread(
            target=self._monitor, name="specinfer-workers-monitor", daemon=True
        ).start()
        try:
            self.group = connect(0, spec.tp, spec.pp, host, port, rank_device(spec.device, 0),
                                 STEP_TIMEOUT)  # fmt: skip
        except Exception as e:
            raise self.fail(e, "the workers did not connect") from e

    def wait_loaded(self) -> None:
        """Wait (while they live, at most LOAD_TIMEOUT) until every worker loaded its shard."""
        deadline = time.monotonic() + LOAD_TIMEOUT
        for rank in range(1, self.size):
            while not self.group.store.check([f"loaded/{rank}"]):  # polled: no timeout logs
                if self.failure or time.monotonic() > deadline:
                    error = TimeoutError(f"not loaded after {LOAD_TIMEOUT:.0f} s")
                    raise self.fail(error, f"worker {rank} did not load its shard")
                time.sleep(0.05)

    def run(self, op: str, args: list, local):
        """Send `op` to the workers, then run `local()` (rank 0's part of it)."""
        if self.failure:
            raise WorkerError(self.failure)
        try:
            self.group.send((op, args))
            return local()
        except (dist.DistError, RuntimeError) as e:  # not ValueError: bad input raises alike
            raise self.fail(e, "a collective or transfer between ranks failed") from e

    def fail(self, error: Exception, what: str) -> WorkerError:
        """Close everything and return the error to raise: the dead or failed worker named if
        there is one (given a moment to be seen), else `what` and the collective's error."""
        for _ in range(20):
            why = self.failure or self._why()
            if why:
                break
            time.sleep(0.1)
        self.failure = why or f"{what}: {error}"
        self.close()
        return WorkerError(self.failure)

    def _why(self) -> str | None:
        try:
            rank, text = self.errors.get_nowait()
            return f"worker {rank} failed:\n{text}"
        except (queue.Empty, OSError, ValueError):
            pass
        for rank, p in enumerate(self.procs, 1):
            if p.exitcode is not None:
                return f"worker {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def _monitor(self) -> None:
        """Notes a worker's death at once, so even an idle engine reports it on its next call."""
        while not self._stop.wait(0.5):
            why = self._why()
            if why:
                self.failure = self.failure or why
                return

    def close(self) -> None:
        """Stop every worker (a stop message, then terminate, then kill) and the groups."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        atexit.unregister(self.close)
        if self.group is not None and not self.failure:
            try:
                self.group.send(("stop", []))
            except Exception:
                pass
        stop_processes(self.procs, grace=10)
        if self.group is not None:
            self.group.shutdown()
        self.errors.close()
        self.errors.join_thread()


def stop_processes(procs: list, grace: float) -> None:
    """Wait `grace` seconds for each process to exit (it was told to stop), then terminate it,
    then kill it."""
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _spawned_worker(rank: int, host: str, port: int, spec: ShardSpec, errors) -> None:
    try:
        run_worker(rank, host, port, spec)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_worker(rank: int, host: str, port: int, spec: ShardSpec) -> None:
    """A worker's life: join the groups, load the shard, run rank 0's calls until "stop"."""
    from specinfer.engine.model_runner import ModelRunner

    torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = connect(rank, spec.tp, spec.pp, host, port, device, STEP_TIMEOUT)
    from specinfer.layers import pack_linears

    model = build_shard(spec, group)
    if device.type == "cpu":  # as rank 0's Engine packs its shard
        pack_linears(model, head=False)
    runner = ModelRunner(model, device, parallel=group)
    group.store.set(f"loaded/{rank}", "1")
    while True:
        op, args = group.recv()
        if op == "stop":
            break
        getattr(runner, op)(*args)
    group.shutdown()
