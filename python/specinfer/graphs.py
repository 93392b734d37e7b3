"""Replaying a model's decode steps on the CPU without Python: `GraphRunner`.

At decode sizes a step of a small model is ~300 compiled ops, and the Python between them (module
calls, views, allocations) costs a third of the step. `_C.OpGraph` records the compiled ops of one
forward and replays them in one call, on the same tensors: the CPU analogue of a CUDA graph. So a
recorded forward reads its inputs from fixed buffers, which each call refills, and its output lands
in a fixed buffer too. A graph is recorded per input shape, the first time that shape is seen
(recording runs the ops, so it costs about an eager forward), and holds only what its ops touch:
one KV cache and its intermediate activations. The engine keeps its KV cache from batch to batch
when it is large enough, so the graphs recorded in one `generate` replay in the next.

Only ops of the compiled core can be recorded; a torch op in the recorded region would not be
replayed. So models opt in (`graph_safe`: every op of their `decode` is compiled), and while a graph
records, every torch fallback in `specinfer.ops` refuses to run (`ops.refuse_while_recording`):
a recording that would be incomplete fails, and that shape runs eagerly from then on.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from specinfer import ops

# SPECINFER_CPU_GRAPHS=0 runs every forward eagerly (e.g. to rule graphs out when debugging).
ENABLED = os.environ.get("SPECINFER_CPU_GRAPHS", "1") != "0"
# Rows (batch x new tokens) up to which a forward is recorded: decode steps, trees and SSM levels.
MAX_ROWS = 64
# Rows of all the graphs kept, least recently used dropped first. Each graph keeps its
# activations, ~0.4 MB per row for a 30-layer model of width 576. An SSM drafting an 8-level tree
# cycles through ~10 small shapes a step: fewer graphs than that and LRU misses every time.
MAX_KEPT_ROWS = 512


class _Recorded:
    """One recorded forward: its input buffers, its output and the op graph between them; for
    a model whose layers are streamed (offload.py), one graph per stretch between two streamed
    layers, each replayed after its layer is brought in."""

    def __init__(self, model, kv, inputs: list[torch.Tensor]):
        self.inputs = [t.clone() for t in inputs]
        self.rows = inputs[0].shape[0] * inputs[0].shape[1]
        self.streamer = getattr(model, "layer_streamer", None)
        self.segments = [(None, ops._C.OpGraph())]  # (streamed layer brought in first, graph)
        h, positions, cache_rows, prefix_lens, slots, tree_mask = self.inputs
        self.segments[0][1].begin()
        if self.streamer is not None:
            self.streamer.split = self._split
        try:
            self.output = model.decode(h, positions, kv, cache_rows, prefix_lens, slots, tree_mask)
            self.taps = _taps(model)  # replays refill these too
        finally:
            self.segments[-1][1].end()
            if self.streamer is not None:
                self.streamer.split = None

    def _split(self, layer: int) -> None:
        self.segments[-1][1].end()
        self.segments.append((layer, ops._C.OpGraph()))
        self.segments[-1][1].begin()

    def replay(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        for layer, graph in self.segments:
            if layer is not None:
                self.streamer.bring_in(layer)
            graph.replay()
        return self.output.clone()  # the next replay overwrites the buffer


def _taps(model) -> list[torch.Tensor]:
    return model.taps() if hasattr(model, "taps") else []


class GraphRunner:
    """`runner(input_ids, positions, kv, cache_rows, prefix_lens, tree_mask)` is
    `model(...)`, with `model.decode` replayed from a recorded graph where it can be: a graph-safe
    model on the CPU, in inference mode, with at most MAX_ROWS new tokens in all. `taps` holds
    the last call's kept layer inputs (LlamaForCausalLM.tap), valid until the next call."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.enabled = (
            ENABLED
            and ops._C is not None
            and hasattr(ops._C, "OpGraph")
            and getattr(model, "graph_safe", False)
        )
        self._graphs: OrderedDict = OrderedDict()
        self._refused: set = set()  # shapes whose forward used an op a graph cannot hold
        self._kv = None
        self.replays = 0  # forwards run from a graph, for tests and profiling
        self.taps: list[torch.Tensor] = []
        # Whether the last call ran as a call of its shape will run again, so its time prices
        # the shape: True after a replay, or an eager run too wide for any graph (no graph will
        # ever be recorded for it); False after a recording; None when graphs play no part (a
        # GPU, graphs off), where only the caller can tell (its shape seen before or not).
        self.warm: bool | None = None

    def __call__(
        self, input_ids, positions, kv, cache_rows, prefix_lens, tree_mask
    ) -> torch.Tensor:
        key = self._key(input_ids, positions, kv, cache_rows, prefix_lens, tree_mask)
        if key is None:
            self.warm = self._eager_warm(input_ids)
            out = self.model(input_ids, positions, kv, cache_rows, prefix_lens, tree_mask)
            self.taps = _taps(self.model)
            return out
        return self._run(key, self.model.embed(input_ids), positions, kv, cache_rows, prefix_lens,
                         tree_mask)  # fmt: skip

    def embedded(self, h, positions, kv, cache_rows, prefix_lens, tree_mask) -> torch.Tensor:
        """The same from the first layer's input h [B, T, H] (a feature head's fused input)."""
        key = self._key(h[..., 0], positions, kv, cache_rows, prefix_lens, tree_mask)
        if key is None:
            self.warm = self._eager_warm(h[..., 0])
            return self._eager(h, positions, kv, cache_rows, prefix_lens, tree_mask)
        return self._run(key, h, positions, kv, cache_rows, prefix_lens, tree_mask)

    def _eager(self, h, positions, kv, cache_rows, prefix_lens, tree_mask) -> torch.Tensor:
        slots = prefix_lens[:, None] + torch.arange(h.shape[1], device=h.device)
        out = self.model.decode(h, positions, kv, cache_rows, prefix_lens, slots, tree_mask)
        self.taps = _taps(self.model)
        return out

    def _run(self, key, h, positions, kv, cache_rows, prefix_lens, tree_mask) -> torch.Tensor:
        slots = prefix_lens[:, None] + torch.arange(h.shape[1])
        inputs = [h, positions, cache_rows, prefix_lens, slots, tree_mask]
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            self.warm = True
            out = graph.replay(inputs)
        else:
            self.warm = False
            try:
                graph = _Recorded(self.model, kv, inputs)
            except ops.RecordingRefused:
                self._refused.add(key)
                if getattr(self.model, "layer_streamer", None) is not None:
                    self.enabled = False  # each try streams layers again (offload.py): stop
                return self._eager(h, positions, kv, cache_rows, prefix_lens, tree_mask)
            self._graphs[key] = graph
            while sum(g.rows for g in self._graphs.values()) > MAX_KEPT_ROWS:
                self._graphs.popitem(last=False)
            out = graph.output.clone()
        self.taps = graph.taps
        return out

    def _eager_warm(self, input_ids: torch.Tensor) -> bool | None:
        """`warm` for an eager call: True where graphs are recorded but this one is too wide."""
        wide = input_ids.shape[0] * input_ids.shape[1] > MAX_ROWS
        return True if self.enabled and input_ids.is_cpu and wide else None

    def release(self) -> None:
        """Drop every graph (and with them the cache and buffers they hold)."""
        self._graphs.clear()
        self._refused.clear()
        self._kv = None

    def _key(self, input_ids, positions, kv, cache_rows, prefix_lens, tree_mask):
        """The graph key of this call, or None when it must run eagerly."""
        B, T = input_ids.shape
        if not (self.enabled and input_ids.is_cpu and B * T <= MAX_ROWS):
            return None
        if (
            not torch.is_inference_mode_enabled()
        ):  # buffers recorded in it can't be refilled outside
            return None
        if kv is not self._kv:  # a new cache: graphs of the old one would keep it alive
            self.release()
            self._kv = kv
        key = (tuple(tree_mask.shape), positions.dtype, cache_rows.dtype, prefix_lens.dtype,
               tree_mask.dtype)  # fmt: skip
        return None if key in self._refused else key
