"""Recorded op graphs (specinfer.graphs): a replayed forward is bit-identical to the eager one,
for decode steps, token trees and SSM levels, and anything a graph cannot hold runs eagerly."""

from __future__ import annotations

from itertools import zip_longest

import pytest
import torch

from specinfer import Engine, SamplingParams, graphs, ops
from specinfer.graphs import GraphRunner
from test_models import build_pair
from test_speculative import _tiny_llama

pytestmark = pytest.mark.skipif(ops._C is None, reason="needs the compiled extension")


def _random_tree_mask(B: int, T: int, M: int, gen: torch.Generator) -> torch.Tensor:
    """Each new node sees itself and a random ancestor chain (parents before children); with
    M > T the first M - T columns are earlier nodes every row may see."""
    mask = torch.zeros(B, T, M, dtype=torch.bool)
    mask[:, :, : M - T] = True
    for b in range(B):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, T)]
        for i in range(T):
            j = i
            while j >= 0:
                mask[b, i, M - T + j] = True
                j = parents[j]
    return mask


def _steps(B: int, S: int):
    """A prefill, decode steps, trees and SSM-style levels (M > T), rows swapped at times."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.zeros(B, dtype=torch.long)
    shapes = [(7, 7)] + [(1, 1)] * 4 + [(4, 4)] * 3 + [(3, 5)] * 3 + [(1, 1)] * 2
    for i, (T, M) in enumerate(shapes):
        rows = torch.arange(B) if i % 3 else torch.arange(B).flip(0)
        mask = (
            torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).clone()
            if i == 0 or T == 1
            else _random_tree_mask(B, T, M, gen)
        )
        ids = torch.randint(0, 256, (B, T), generator=gen)
        positions = prefix[:, None] + torch.randint(0, 2, (B, T), generator=gen).cumsum(1)
        yield ids, positions, rows, prefix.clone(), mask
        prefix = prefix + torch.randint(1, T + 1, (B,), generator=gen)  # accepted tokens
        assert int(prefix.max()) + 8 <= S


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "llama3-rope"])
def test_replayed_forwards_equal_eager_ones(tmp_path, name):
    _, model = build_pair(name, tmp_path, dtype=torch.bfloat16)
    runner = GraphRunner(model)
    assert runner.enabled
    model.tap((0, model.config.num_layers - 1))  # what a feature head reads comes along
    B, S = 2, 64
    with torch.inference_mode():
        kv_eager, kv_graph = model.make_kv_cache(B, S), model.make_kv_cache(B, S)
        for step, (ids, positions, rows, prefix, mask) in enumerate(_steps(B, S)):
            expected = model(ids, positions, kv_eager, rows, prefix, mask)
            taps = [t.clone() for t in model.taps()]
            got = runner(ids, positions, kv_graph, rows, prefix, mask)
            assert torch.equal(got, expected), f"step {step}: hidden states differ"
            assert len(runner.taps) == 2
            assert all(torch.equal(a, b) for a, b in zip(runner.taps, taps)), f"step {step}"
        for a, b in zip(kv_eager.k + kv_eager.v, kv_graph.k + kv_graph.v):
            assert torch.equal(a, b)
    # each shape (prefill (7,7), decode (1,1), trees (4,4), levels (3,5)) recorded once, then
    # replayed: 13 forwards
    assert len(runner._graphs) == 4 and runner.replays == 13 - 4


def test_a_forward_with_torch_ops_is_refused_and_runs_eagerly(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "FAST_LINEAR_FP32", False)  # fp32 linear is torch's
    _, model = build_pair("llama-gqa", tmp_path, dtype=torch.float32)
    assert not model.graph_safe  # so a runner would not try; this one is made to
    monkeypatch.setattr(type(model), "graph_safe", property(lambda self: True))
    runner = GraphRunner(model)
    assert runner.enabled
    with torch.inference_mode():
        kv_eager, kv_graph = model.make_kv_cache(1, 64), model.make_kv_cache(1, 64)
        for ids, positions, rows, prefix, mask in _steps(1, 64):
            expected = model(ids, positions, kv_eager, rows, prefix, mask)
            assert torch.equal(runner(ids, positions, kv_graph, rows, prefix, mask), expected)
    assert not runner._graphs and runner._refused


def test_models_that_are_not_graph_safe_run_eagerly(tmp_path):
    _, opt = build_pair("opt-pre-ln", tmp_path, dtype=torch.bfloat16)
    assert not GraphRunner(opt).enabled


def _decode(runner, kv, position: int, prefix: int, row: int = 0) -> torch.Tensor:
    """One single-token step of request `row`."""
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    ids, rows = torch.tensor([[5]]), torch.tensor([row])
    return runner(ids, torch.tensor([[position]]), kv, rows, torch.tensor([prefix]), one)


def test_a_replay_checks_indices_again(tmp_path):
    _, model = build_pair("llama-gqa", tmp_path, dtype=torch.bfloat16)
    runner = GraphRunner(model)
    with torch.inference_mode():
        kv = model.make_kv_cache(1, 16)
        for p in range(3):  # recorded, replayed, replayed
            _decode(runner, kv, p, p)
        assert runner._graphs and runner.replays == 2
        with pytest.raises(ValueError, match="kv_write|slot"):
            _decode(runner, kv, 3, 16)
        with pytest.raises(ValueError, match="cache_rows|row"):
            _decode(runner, kv, 3, 3, row=1)
        _decode(runner, kv, 3, 3)  # the graph still works after a failed replay
        assert runner.replays == 5


def test_the_runner_says_which_forwards_ran_as_their_shape_will_again(tmp_path, monkeypatch):
    """`warm` (what the budget prices a shape by): False after a recording, True after a
    replay or an eager forward too wide for any graph, None where graphs play no part."""
    _, model = build_pair("llama-gqa", tmp_path, dtype=torch.bfloat16)
    runner = GraphRunner(model)
    monkeypatch.setattr(graphs, "MAX_ROWS", 4)
    with torch.inference_mode():
        kv = model.make_kv_cache(2, 32)
        states = []
        for p in range(2):  # recorded, then replayed
            _decode(runner, kv, p, p)
            states.append(runner.warm)
        T = 3  # 2 x 3 rows: past MAX_ROWS, eager
        ids, rows = torch.full((2, T), 5), torch.arange(2)
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T).clone()
        prefix = torch.tensor([2, 0])
        runner(ids, prefix[:, None] + torch.arange(T), kv, rows, prefix, mask)
        states.append(runner.warm)
        runner.enabled = False
        _decode(runner, kv, 2, 2)
        states.append(runner.warm)
    assert states == [False, True, True, None]


def test_a_new_cache_drops_the_graphs_of_the_old_one(tmp_path):
    _, model = build_pair("llama-gqa", tmp_path, dtype=torch.bfloat16)
    runner = GraphRunner(model)
    recorded = []
    with torch.inference_mode():
        for kv in (model.make_kv_cache(1, 16), model.make_kv_cache(1, 16)):
            for p in range(2):
                _decode(runner, kv, p, p)
            assert len(runner._graphs) == 1
            recorded.append(next(iter(runner._graphs.values())))
    assert recorded[0] is not recorded[1]
    runner.release()
    assert not runner._graphs and runner._kv is None


def test_op_graph_rules(monkeypatch):
    monkeypatch.setattr(ops, "FAST_LINEAR_FP32", False)  # fp32 linear is torch's
    x, w = torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    out = torch.empty(1, 4, dtype=torch.bfloat16)
    g = ops._C.OpGraph()
    g.begin()
    try:
        with pytest.raises(RuntimeError, match="another graph"):
            ops._C.OpGraph().begin()
        with pytest.raises(RuntimeError, match="while recording"):
            g.replay()
        with pytest.raises(ValueError, match="kv_commit: cannot run while an OpGraph records"):
            ops._C.kv_commit([], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                             torch.zeros(1, 1, dtype=torch.long))  # fmt: skip
        with pytest.raises(ops.RecordingRefused, match="linear"):
            ops.linear(x.float(), w.float())
        ops._C.linear(x, w, None, out)
    finally:
        g.end()
    assert len(g) == 1
    expected = out.clone()
    out.zero_()
    x2 = x.clone()
    x.mul_(2)  # a replay reads the tensors' current contents
    g.replay()
    assert torch.equal(out, ops.linear(x, w))
    x.copy_(x2)
    g.replay()
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("graphs") / "target", seed=3, layers=3)


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"ssm": "layers:1", "tree": "2,1,1"},
        {"ssm": ["layers:2", "ngram"], "tree": ["1,2", None]},
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_output_is_the_same_with_and_without_graphs(
    tiny_bf16, monkeypatch, spec, temperature
):
    prompts = [[1, 4, 2, 2, 4, 1], [3, 3, 1]]
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
    outs = {}
    for enabled in (False, True):
        monkeypatch.setattr(graphs, "ENABLED", enabled)
        engine = Engine(tiny_bf16, dtype="bfloat16", max_batch_size=2, **spec)
        outs[enabled] = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.run_model.enabled == enabled
        assert (engine.run_model.replays > 0) == enabled
        for ssm in getattr(engine.drafter, "ssms", []):
            if hasattr(ssm, "run_model"):
                assert (ssm.run_model.replays > 0) == enabled
    assert outs[True] == outs[False]


def test_graphs_are_kept_up_to_a_row_budget(tmp_path, monkeypatch):
    """An SSM's deep tree cycles through more shapes than a handful: all of them stay recorded
    (a count cap below the cycle would make LRU miss every time); past the budget of rows the
    least recently used goes."""
    _, model = build_pair("llama-gqa", tmp_path, dtype=torch.bfloat16)
    runner = GraphRunner(model)
    widths = range(1, 13)  # 12 level shapes, 78 rows in all

    def level(kv, M):
        mask = torch.ones(1, 1, M, dtype=torch.bool)
        ids, pos = torch.tensor([[5]]), torch.tensor([[M - 1]])
        return runner(ids, pos, kv, torch.tensor([0]), torch.tensor([M - 1]), mask)

    def levels(kv, T):
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        ids, pos = torch.full((1, T), 5), torch.arange(T)[None]
        return runner(ids, pos, kv, torch.tensor([0]), torch.tensor([0]), mask)

    with torch.inference_mode():
        kv = model.make_kv_cache(1, 32)
        for _ in range(2):  # recorded, replayed
            for M in widths:
                level(kv, M)
        assert len(runner._graphs) == len(widths) and runner.replays == len(widths)
        monkeypatch.setattr(graphs, "MAX_KEPT_ROWS", 16)
        levels(kv, 8)
        kept = [key[0] for key in runner._graphs]
        assert kept[-1] == (1, 8, 8) and sum(b * t for b, t, _ in kept) <= 16
        assert (1, 1, 12) in kept and (1, 1, 1) not in kept  # the oldest went first


@pytest.mark.parametrize("spec", [{}, {"ssm": ["layers:2", "ngram"], "tree": ["1,2", None]}])
def test_graphs_recorded_in_one_generate_replay_in_the_next(tiny_bf16, spec):
    """The engine keeps its KV caches (and the SSMs theirs) from request to request, so a
    second call replays from its first decode step, with the same outputs; a longer request
    uses the same caches and graphs (they are sized for max_model_len once, never re-sized)."""
    engine = Engine(tiny_bf16, dtype="bfloat16", max_batch_size=2, **spec,
                    adaptive_tree=False)  # fmt: skip
    # whole trees: the SSM drafts every step, whatever this machine's timings
    prompts = [[1, 4, 2, 2, 4, 1], [3, 3, 1]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    first = [c.token_ids for c in engine.generate(prompts, params)]
    runners = [engine.run_model] + [s.run_model for s in getattr(engine.drafter, "ssms", [])
                                    if hasattr(s, "run_model")]  # fmt: skip
    graphs_before = [dict(r._graphs) for r in runners]
    replays_before = [r.replays for r in runners]
    assert [c.token_ids for c in engine.generate(prompts, params)] == first
    for runner, before, replays in zip(runners, graphs_before, replays_before):
        assert all(runner._graphs.get(key) is g for key, g in before.items())
        assert runner.replays > replays
    kvs = [engine.kv.kv] + [s.kv for s in getattr(engine.drafter, "ssms", []) if hasattr(s, "kv")]
    assert engine.kv.capacity >= engine.max_model_len  # a block table addresses it all
    assert all(kv.max_seq_len >= engine.max_model_len for kv in kvs[1:])
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    longer = [c.token_ids for c in engine.generate(prompts, long)]
    assert [t[:16] for t in longer] == first
    assert engine.kv.kv is kvs[0]
    for runner, before in zip(runners, graphs_before):
        assert all(runner._graphs.get(key) is g for key, g in before.items())
    engine.release()  # memory back; the next call starts over
    assert all(not r._graphs for r in runners) and engine.kv.kv is None
    assert all(s.kv is None for s in getattr(engine.drafter, "ssms", []) if hasattr(s, "kv"))
    assert [c.token_ids for c in engine.generate(prompts, params)] == first


@pytest.mark.parametrize("spec", [{}, {"ssm": "layers:2", "tree": "1,1"}])
def test_interleaved_streams(tiny_bf16, spec):
    """Two unfinished streams share the running batch (each step advances both), speculative
    or not, with each one's own output; release is refused while one is unfinished, and
    closing a stream early frees its request."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = Engine(tiny_bf16, dtype="bfloat16", **spec)
    expected = [engine.generate(p, params)[0].text for p in ("t1 t4 t2", "t3 t3")]
    a, b = engine.stream("t1 t4 t2", params), engine.stream("t3 t3", params)
    texts = ["", ""]
    for pieces in zip_longest(a, b, fillvalue=""):  # one step of each in turn
        texts = [t + p for t, p in zip(texts, pieces)]
    assert texts == expected
    first = engine.stream("t1 t4 t2", params)
    next(first)
    with pytest.raises(RuntimeError, match="cannot release while requests run"):
        engine.release()
    first.close()  # closing the stream frees the engine
    assert not engine.has_unfinished()
    assert engine.generate("t3 t3", params)[0].text == expected[1]
