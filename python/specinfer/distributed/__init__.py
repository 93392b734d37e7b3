"""Tensor and pipeline parallelism: the target sharded over tp x pp processes (group.py: where a
rank sits and its process groups; workers.py: the worker processes and their loop). Rank 0
runs the Engine (scheduler, SSMs, verification); every rank runs the target's ModelRunner over
its shard: its pipeline stage's layers, its tensor-parallel slice of them."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch

from specinfer import ops
from specinfer.distributed.workers import ShardSpec, WorkerError, Workers, build_shard, run_worker

__all__ = ["WorkerError", "load_target", "ssm_view", "torchrun_rank"]


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun with more than one process, else None."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _degree(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def load_target(path, dtype: torch.dtype, device: torch.device, tensor_parallel: int = 1,
                threads: int | None = None, pipeline_parallel: int = 1):  # fmt: skip
    """(model, workers): the whole target and None, or rank 0's shard and its Workers. Under
    torchrun, a rank other than 0 serves rank 0 here and then exits the process. Each rank
    runs `threads` threads, by default the CPU's cores shared out (no oversubscription)."""
    from specinfer.loader import load_model

    tp = _degree(tensor_parallel, "tensor_parallel")
    pp = _degree(pipeline_parallel, "pipeline_parallel")
    launched = torchrun_rank()
    if launched and tp * pp not in (1, launched[1]):
        raise ValueError(
            f"tensor_parallel={tp} x pipeline_parallel={pp} but torchrun started {launched[1]} "
            "processes; start as many (or leave both at 1 to use them all for tensor parallelism)"
        )
    if launched and tp * pp == 1:
        tp = launched[1]
    size = tp * pp
    if size == 1:
        return load_model(path, dtype=dtype, device=device), None
    if threads is None and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    spec = ShardSpec(str(path), dtype, device.type, torch.get_num_threads(), tp, pp)
    if launched and launched[0] != 0:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
        run_worker(launched[0], host, port, spec)
        raise SystemExit(0)
    workers = Workers(spec, torchrun=bool(launched))
    try:
        model = build_shard(spec, workers.group)
        workers.wait_loaded()
    except BaseException:
        workers.close()
        raise
    return model, workers


def ssm_view(runner, ssm_specs) -> SimpleNamespace:
    """What the drafters may use of a sharded target: its config, its whole embedding and LM
    head (gathered once from the shards, for a compact SSM that shares them), and
    `layer_selected(n)`: a layer-selected SSM whose layers (the target's shards) run on every
    rank (MirroredSSM). Under pipeline parallelism layer selection is refused."""
    specs = ssm_specs if isinstance(ssm_specs, (list, tuple)) else [ssm_specs]
    layered = [s for s in specs if isinstance(s, int) or str(s).startswith("layers:")]
    if layered and runner.par.pp > 1:
        raise ValueError(
            f"ssm {layered[0]!r} (a layer-selected SSM) would span pipeline stages; use a "
            "separate SSM model or ngram with pipeline_parallel"
        )
    embed, head = runner.gather_embeddings()
    tied = head is embed
    embed = torch.nn.Parameter(embed, requires_grad=False)
    head = embed if tied else torch.nn.Parameter(head, requires_grad=False)
    config = runner.model.config
    return SimpleNamespace(config=config,
                           model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)),
                           lm_head=SimpleNamespace(weight=head),
                           layer_selected=lambda n: MirroredSSM(runner, n, config, head))  # fmt: skip


class MirroredSSM:
    """Rank 0's face of a layer-selected SSM over a tensor-parallel target: its cache, forwards
    and commits run on every rank (ModelRunner.ssm_*: each rank's first n sharded layers and
    its own cache for them); its logits on rank 0 alone, with the whole head."""

    graph_safe = False

    def __init__(self, runner, n: int, config, head: torch.Tensor):
        self.runner, self.n = runner, n
        self.config = dataclasses.replace(config, num_layers=n)
        self.lm_head = SimpleNamespace(weight=head)

    def make_kv_cache(self, rows: int, max_seq_len: int):
        return self.runner._call("ssm_cache", self.n, rows, max_seq_len)

    def __call__(self, input_ids, positions, kv, cache_rows, prefix_lens, tree_mask):
        return self.runner._call("ssm_forward", self.n, input_ids, positions, cache_rows,
                                 prefix_lens, tree_mask)  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head.weight).float()

    def commit_kv(self, kv, rows, prefix, accepted) -> None:
        self.runner._call("ssm_commit", self.n, rows, prefix, accepted)
