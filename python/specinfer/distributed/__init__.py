"""Tensor and pipeline parallelism: the target sharded over tp x pp processes (group.py: where a
rank sits and its process groups; workers.py: the worker processes and their loop). Rank 0
runs the Engine (scheduler, SSMs, verification); every rank runs the target's ModelRunner over
its shard: its pipeline stage's layers, its tensor-parallel slice of them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

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
    """What the drafters may use of a sharded target: its config and its whole embedding and
    LM head (gathered once from the shards, for a compact SSM that shares them). A
    layer-selected SSM would run the target's sharded layers on rank 0 alone: refused."""
    specs = ssm_specs if isinstance(ssm_specs, (list, tuple)) else [ssm_specs]
    for spec in specs:
        if isinstance(spec, int) or str(spec).startswith("layers:"):
            raise ValueError(
                f"ssm {spec!r} (a layer-selected SSM) shares the target's layers, which "
                "tensor and pipeline parallelism shard; use a separate SSM model or ngram"
            )
    embed, head = runner.gather_embeddings()
    tied = head is embed
    embed = torch.nn.Parameter(embed, requires_grad=False)
    head = embed if tied else torch.nn.Parameter(head, requires_grad=False)
    return SimpleNamespace(config=runner.model.config,
                           model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)),
                           lm_head=SimpleNamespace(weight=head))  # fmt: skip
