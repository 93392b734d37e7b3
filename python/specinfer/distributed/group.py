"""The ranks that run one model: where this rank sits (pipeline stage, tensor-parallel rank) and
its process groups.

Ranks are laid out stage by stage: rank = stage * tp + tp_rank; rank 0 (stage 0, TP rank 0)
drives. Each engine makes its own process groups from its own TCPStore (a free port), so two
engines in one process or on one host never share one. Three kinds:
- `ctrl` (gloo, all ranks, no deadline): rank 0's calls to every worker, who waits on it while
  the engine is idle;
- `tp` (gloo on CPU, NCCL on CUDA): a stage's TP ranks, for the layers' collectives;
- `p2p` (gloo, all ranks): hidden states from stage to stage and logits back to rank 0.
The last two run under the step deadline, so a rank that hangs mid-step is an error on rank 0.

Layers built inside `with tensor_parallel(group, stage, stages):` shard themselves over the TP
group, and a model keeps only its stage's layers; anything built outside (a separate SSM) has
the world-1 group and one stage, so it stays whole.
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
    """A stage's tensor-parallel ranks and their collectives."""

    def __init__(self, rank: int, size: int, pg=None):
        self.rank, self.size, self.pg = rank, size, pg
        self.comm_s = 0.0  # seconds in collectives (waiting for peers included)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place. Half types travel in float32 (gloo sums bf16 in bf16)."""
        ops.refuse_while_recording("all_reduce")  # a recorded graph would skip it
        start = time.perf_counter()
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) and not x.is_cuda else x
        if self.pg is None:  # torchrun's default group, not held (see current_group)
            dist.all_reduce(wide)
        else:
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
        if self.pg is None:
            dist.all_gather(parts, x)
        else:
            self.pg.allgather([parts], [x]).wait()
        self.comm_s += time.perf_counter() - start
        return parts


class Parallel:
    """This rank's place among tp x pp ranks, and its groups (see the module docstring)."""

    def __init__(self, rank: int, tp: int, pp: int, tp_group: TPGroup, ctrl=None, p2p=None,
                 store=None):  # fmt: skip
        self.rank, self.world, self.pp = rank, tp * pp, pp
        self.stage, self.tp = rank // tp, tp_group
        self.ctrl, self.p2p, self.store = ctrl, p2p, store
        self.comm_s = 0.0  # seconds in sends to the workers and stage-to-stage transfers

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int) -> int:
        """The rank holding this rank's TP shard at `stage`."""
        return stage * self.tp.size + self.tp.rank

    def send(self, obj) -> None:
        """Rank 0: broadcast a picklable object (tensors on the CPU) to every worker."""
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

    def send_tensor(self, x: torch.Tensor, dst: int, tag: int):
        """Start sending x to rank dst; the returned work must be waited on before x changes."""
        return self.p2p.send([x.detach().cpu().contiguous()], dst, tag)

    def recv_tensor(self, shape, dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        x = torch.empty(shape, dtype=dtype)
        self.p2p.recv([x], src, tag).wait()
        self.comm_s += time.perf_counter() - start
        return x

    @property
    def total_comm_s(self) -> float:
        return self.comm_s + self.tp.comm_s

    def shutdown(self) -> None:
        for pg in (self.tp.pg, self.ctrl, self.p2p):
            if pg is not None:
                with contextlib.suppress(Exception):
                    pg.shutdown()
        self.tp.pg = self.ctrl = self.p2p = None


def _root():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


SINGLE = TPGroup(0, 1)
_current: tuple[TPGroup, int, int] | None = None  # (TP group, stage, stages) being built


def current_group() -> TPGroup:
    """The group layers being built now shard over: the one set by `tensor_parallel`, else the
    default group when torch.distributed is up (torchrun), else a single rank."""
    if _current is not None:
        return _current[0]
    if dist.is_available() and dist.is_initialized():
        # The default group is used through dist's functions, not held: a model that outlives
        # destroy_process_group() must not keep the group object alive (it aborts at exit).
        return TPGroup(dist.get_rank(), dist.get_world_size())
    return SINGLE


def current_stage() -> tuple[int, int]:
    """(stage, stages) of the model being built: (0, 1) outside `tensor_parallel`."""
    return (_current[1], _current[2]) if _current is not None else (0, 1)


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """A stage's contiguous share of the layers, the first stages taking one more if they do
    not divide."""
    if stages > num_layers:
        raise ValueError(
            f"pipeline_parallel={stages} exceeds the model's {num_layers} layers (a stage needs one)"
        )
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


@contextlib.contextmanager
def tensor_parallel(group: TPGroup, stage: int = 0, stages: int = 1):
    global _current
    before, _current = _current, (group, stage, stages)
    try:
        yield group
    finally:
        _current = before


def connect(rank: int, tp: int, pp: int, host: str, port: int, device: torch.device,
            step_timeout: float) -> Parallel:  # fmt: skip
    """Join the ranks whose rank 0 listens on host:port (rank 0 creates the store)."""
    world = tp * pp
    store = dist.TCPStore(host, port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=max(step_timeout, 60)))  # fmt: skip
    deadline = datetime.timedelta(seconds=step_timeout)
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world,
                                 datetime.timedelta(days=365))  # fmt: skip
    p2p = None
    if pp > 1:
        p2p = dist.ProcessGroupGloo(dist.PrefixStore("p2p", store), rank, world, deadline)
    stage, tp_rank = divmod(rank, tp)
    pg = None
    if tp > 1:
        prefixed = dist.PrefixStore(f"tp{stage}", store)
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(prefixed, tp_rank, tp)
        else:
            pg = dist.ProcessGroupGloo(prefixed, tp_rank, tp, deadline)
    return Parallel(rank, tp, pp, TPGroup(tp_rank, tp, pg), ctrl, p2p, store)
