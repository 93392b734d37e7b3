"""Tensor parallelism: the target sharded over N processes (group.py: the collectives;
workers.py: the worker processes and their loop). Rank 0 runs the Engine (scheduler, SSMs,
verification); every rank runs the target's ModelRunner over its shard."""

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


def load_target(path, dtype: torch.dtype, device: torch.device, tensor_parallel: int,
                threads: int | None = None):  # fmt: skip
    """(model, workers): the whole target and None, or rank 0's shard and its Workers. Under
    torchrun, a rank other than 0 serves rank 0 here and then exits the process. Each rank
    runs `threads` threads, by default the CPU's cores shared out (no oversubscription)."""
    from specinfer.loader import load_model

    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool):
        raise ValueError(f"tensor_parallel must be an integer, got {tensor_parallel!r}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    launched = torchrun_rank()
    if launched and tensor_parallel not in (1, launched[1]):
        raise ValueError(
            f"tensor_parallel={tensor_parallel} but torchrun started {launched[1]} processes; "
            "start as many as tensor_parallel (or leave it at 1 to use them all)"
        )
    size = launched[1] if launched else tensor_parallel
    if size == 1:
        return load_model(path, dtype=dtype, device=device), None
    if threads is None and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    spec = ShardSpec(str(path), dtype, device.type, torch.get_num_threads())
    if launched and launched[0] != 0:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
        run_worker(launched[0], size, host, port, spec)
        raise SystemExit(0)
    workers = Workers(size, spec, torchrun=bool(launched))
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
                "tensor_parallel shards; use a separate SSM model or ngram"
            )
    embed, head = runner.gather_embeddings()
    tied = head is embed
    embed = torch.nn.Parameter(embed, requires_grad=False)
    head = embed if tied else torch.nn.Parameter(head, requires_grad=False)
    return SimpleNamespace(config=runner.model.config,
                           model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)),
                           lm_head=SimpleNamespace(weight=head))  # fmt: skip
