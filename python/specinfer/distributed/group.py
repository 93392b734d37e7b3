"""A tensor-parallel group: the ranks that hold shards of one model, and their collectives.

Each engine makes its own process groups from its own TCPStore (a free port), so two engines in
one process or on one host never share one; under torchrun the default group is used. Two
groups over the same ranks: `ctrl` (gloo, no deadline) carries rank 0's calls to the workers,
who wait on it while the engine is idle; `pg` runs the model's collectives (gloo on CPU, NCCL on
CUDA) under the step deadline, so a worker that hangs mid-step surfaces on rank 0 as an error.

Layers built inside `with tensor_parallel(group):` shard themselves over that group; anything
built outside (a separate SSM) has the world-1 group and stays whole.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time

import torch
import torch.distributed as dist

from specinfer import ops


class TPGroup:
    def __init__(self, rank: int, size: int, pg=None, ctrl=None):
        self.rank, self.size, self.pg, self.ctrl = rank, size, pg, ctrl
        self.comm_s = 0.0  # seconds spent in collectives and sends (incl. waiting for peers)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place. Half types travel in float32 (gloo sums bf16 in bf16)."""
        ops.refuse_while_recording("all_reduce")  # a recorded graph would skip it
        start = time.perf_counter()
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) and not x.is_cuda else x
        self.pg.allreduce([wide]).wait()
        if wide is not x:
            x.copy_(wide)
        self.comm_s += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        ops.refuse_while_recording("all_gather")
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        self.comm_s += time.perf_counter() - start
        return parts

    def send(self, obj) -> None:
        """Rank 0: broadcast a picklable object (tensors on the CPU) to the workers."""
        start = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.ctrl.broadcast([torch.tensor([data.numel()])], _root()).wait()
        self.ctrl.broadcast([data], _root()).wait()
        self.comm_s += time.perf_counter() - start

    def recv(self):
        """A worker: the next object rank 0 sends."""
        size = torch.zeros(1, dtype=torch.int64)
        self.ctrl.broadcast([size], _root()).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.ctrl.broadcast([data], _root()).wait()
        return pickle.loads(data.numpy().tobytes())

    def shutdown(self) -> None:
        for pg in (self.pg, self.ctrl):
            with contextlib.suppress(Exception):
                pg.shutdown()
        self.pg = self.ctrl = None


def _root():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


SINGLE = TPGroup(0, 1)
_current: TPGroup | None = None


def current_group() -> TPGroup:
    """The group layers being built now shard over: the one set by `tensor_parallel`, else the
    default group when torch.distributed is up (torchrun), else a single rank."""
    if _current is not None:
        return _current
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        return TPGroup(dist.get_rank(), dist.get_world_size(), world, world)
    return SINGLE


@contextlib.contextmanager
def tensor_parallel(group: TPGroup):
    global _current
    before, _current = _current, group
    try:
        yield group
    finally:
        _current = before


def connect(rank: int, size: int, host: str, port: int, device: torch.device,
            step_timeout: float) -> TPGroup:  # fmt: skip
    """Join the group whose rank 0 listens on host:port (rank 0 creates the store)."""
    store = dist.TCPStore(host, port, size, rank == 0,
                          timeout=datetime.timedelta(seconds=max(step_timeout, 60)))  # fmt: skip
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, size,
                                 datetime.timedelta(days=365))  # fmt: skip
    deadline = datetime.timedelta(seconds=step_timeout)
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
    else:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, deadline)
    group = TPGroup(rank, size, pg, ctrl)
    group.store = store  # kept alive: rank 0's process serves it
    return group
