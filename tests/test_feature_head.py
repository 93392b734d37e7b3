"""The feature-level draft head: teacher data with features, training math equal to the serving
draft, export and loading, lossless speculation (greedy and sampled), and the errors."""

import json
from types import SimpleNamespace

import pytest
import torch

from specinfer import Engine, SamplingParams
from specinfer.feature_speculator import FeatureSpeculator
from specinfer.loader import load_model
from specinfer.sampling import Penalties
from specinfer.training.distill import TrainSettings
from specinfer.training.export import export_student
from specinfer.training.feature import (
    build_head,
    chain_acceptance,
    chain_rates,
    train_feature_head,
    unrolled_forward,
)
from specinfer.training.teacher import TeacherSettings, make_teacher_data
from specinfer.tree import TreeConfig
from test_speculative import (
    PROMPT,
    SAMPLES,
    _chi_squared_p,
    _sample_first3,
    exact,  # noqa: F401 (a fixture)
    tiny_pair,  # noqa: F401 (a fixture)
)
from test_training import _prompts
from test_training import tiny as tiny_training  # noqa: F401 (a fixture)

LAYERS = (0, 2)  # of the tiny target's 3: a head reading them too (EAGLE-3's fusion)


def _layered_head(target):
    """A head reading LAYERS, its fc_layers random so that every part of a feature counts."""
    head = build_head(target, feature_layers=LAYERS)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = head.fc_layers.weight
        w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    return head


def _exported(tiny_pair, out, make):  # noqa: F811
    """An (untrained) feature head of the tiny target, exported as the pipeline does."""
    from specinfer.tokenizer import TokenizerWrapper

    target = load_model(tiny_pair[0], torch.float32)
    export_student(make(target), out, TokenizerWrapper.from_path(tiny_pair[0]),
                   list(range(target.config.vocab_size)), {"kind": "feature"}, compact=True)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):  # noqa: F811
    return _exported(tiny_pair, tmp_path_factory.mktemp("feature") / "head", build_head)


@pytest.fixture(scope="module")
def layered_head_dir(tiny_pair, tmp_path_factory):  # noqa: F811
    return _exported(tiny_pair, tmp_path_factory.mktemp("feature") / "layered", _layered_head)


def _features_of(model, ids: list[int], layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's features at every slot of ids: the inputs of `layers`, then the final
    hidden state (eager, no graphs)."""
    T = len(ids)
    kv = model.make_kv_cache(1, T)
    model.tap(layers)
    try:
        with torch.inference_mode():
            final = model(torch.tensor([ids]), torch.arange(T)[None], kv, torch.tensor([0]),
                          torch.tensor([0]), torch.ones(1, T, T, dtype=torch.bool).tril())[0]  # fmt: skip
            return torch.cat([*(t[0] for t in model.taps()), final], dim=-1)
    finally:
        model.tap(())


def test_teacher_data_keeps_the_targets_features(tmp_path, tiny_training):  # noqa: F811
    path, target, _ = tiny_training
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=5, top_k_logits=3, features=True)
    examples = make_teacher_data(engine, target, _prompts(3), settings, tmp_path)
    for e in examples:
        ids = e["prompt"] + e["completion"][:-1]
        assert e["features"].shape == (len(ids), target.config.hidden_size)
        want = _features_of(target, ids).to(torch.float16)
        assert torch.allclose(e["features"].float(), want.float(), atol=1e-2)


@pytest.mark.parametrize("layers", [(), LAYERS], ids=["final", "layers"])
def test_unrolled_training_forward_is_the_serving_draft(tiny_pair, layers):  # noqa: F811
    # Drafting a chain serves pass j's output at slot root + j (its inputs: the true features up
    # to the root, then the head's own outputs): training unrolls exactly what serving runs.
    target = load_model(tiny_pair[0], torch.float32)
    head = _layered_head(target) if layers else build_head(target)
    context = PROMPT + [3, 0, 5, 1]
    features = _features_of(target, context, layers)
    assert features.shape[-1] == head.feature_size
    spec = FeatureSpeculator(head, TreeConfig((1, 1, 1)))
    spec.reset(1, 64)
    spec.admit(0)
    r = len(context) - 1  # the root's slot
    req = SimpleNamespace(row=0, params=SamplingParams(), generator=None,
                          penalties=Penalties(SamplingParams(), PROMPT, 6), output_ids=[],
                          grammar=None)  # fmt: skip
    spec.write_features([req], [0], features[None], [r])  # the target has cached slots < r
    with torch.inference_mode():
        (tree,) = spec.draft([req], [context], [3])
    assert tree.depths == [0, 1, 2, 3]
    ids = torch.tensor([context + tree.tokens[1:3]])
    padded = torch.cat([features[:r], torch.zeros(3, features.shape[1])])[None]
    outs = unrolled_forward(head, ids, padded, passes=3)
    for j in range(3):
        assert torch.allclose(outs[j][0, r + j], spec.drafted[0, j], atol=1e-4), j
        # and the token it proposes next is the serving draft's, with its probability as the
        # proposal's confidence (what the cost-aware cut prices it by)
        probs = head.compute_logits(outs[j][0, r + j]).float().softmax(-1)
        assert probs.argmax().item() == tree.tokens[j + 1]
        assert tree.prop_conf[j] == pytest.approx(probs.max().item(), abs=1e-4)


def test_a_head_started_from_an_ssm_is_that_ssm(tiny_pair):  # noqa: F811
    # fc passes the token embedding through and ignores the feature: every pass is the SSM.
    from specinfer.training.student import train_forward

    target = load_model(tiny_pair[0], torch.float32)
    ssm = load_model(tiny_pair[1], torch.float32)
    ssm.model.embed_tokens.weight = target.model.embed_tokens.weight  # as a compact SSM's
    head = build_head(target, ssm)
    assert head.config.num_layers == ssm.config.num_layers
    ids = torch.tensor([PROMPT + [3, 0, 5, 1]])
    feats = torch.randn(1, ids.shape[1], head.config.hidden_size)
    for out in unrolled_forward(head, ids, feats):
        assert torch.allclose(out, train_forward(ssm, ids), atol=1e-5)


def test_a_head_started_from_a_head_is_that_head(tiny_pair, head_dir):  # noqa: F811
    # Training further starts from the head itself (fc included), not a fresh fc.
    target = load_model(tiny_pair[0], torch.float32)
    start = load_model(head_dir, torch.float32, shared_embeddings_from=target)
    with torch.no_grad():
        start.fc.weight.add_(0.01 * torch.randn_like(start.fc.weight))  # no identity blocks
        start.fc.bias.fill_(0.02)
    head = build_head(target, start)
    assert torch.equal(head.fc.weight, start.fc.weight)
    ids = torch.tensor([PROMPT + [3, 0, 5, 1]])
    feats = torch.randn(1, ids.shape[1], head.config.hidden_size)
    for mine, theirs in zip(
        unrolled_forward(head, ids, feats), unrolled_forward(start, ids, feats)
    ):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_a_head_reading_layers_starts_as_the_head_without_them(tiny_pair, head_dir):  # noqa: F811
    # fc_layers starts reading the final hidden state alone: adding layers to a trained head
    # changes nothing until training makes use of them.
    target = load_model(tiny_pair[0], torch.float32)
    start = load_model(head_dir, torch.float32, shared_embeddings_from=target)
    head = build_head(target, start, feature_layers=LAYERS)
    ids = PROMPT + [3, 0, 5, 1]
    wide = _features_of(target, ids, LAYERS)[None]
    final = wide[..., -head.config.hidden_size :]
    assert not torch.equal(wide[..., : final.shape[-1]], final)  # the layers differ from it
    for mine, theirs in zip(
        unrolled_forward(head, torch.tensor([ids]), wide),
        unrolled_forward(start, torch.tensor([ids]), final),
    ):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_chain_rates_count_whole_prefixes():
    right = torch.tensor
    # depth 1 right at 0, 1, 3; depth 2 (one slot later) right at 1, 2 -> drafts from 0 and 1
    matches = [[right([1, 1, 0, 1]).bool(), right([0, 1, 1, 0]).bool(), right([0, 0, 0, 0]).bool()]]
    assert chain_rates(matches) == {"depth1": 3 / 4, "depth2": 2 / 4, "depth3": 0.0}


@pytest.mark.parametrize("layers", [False, True], ids=["final", "layers"])
@pytest.mark.parametrize("ssm", ["feature", "merged"])
@pytest.mark.parametrize("tree", ["1,1,1", "2,2,1"])
def test_greedy_feature_head_equals_incremental(
    tiny_pair,  # noqa: F811
    head_dir,
    layered_head_dir,
    ssm,
    tree,
    layers,
):
    head_dir = layered_head_dir if layers else head_dir
    prompts = [PROMPT, [2, 2, 5], [0, 1, 2, 3, 4, 5, 1]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(tiny_pair[0], dtype="float32").generate(prompts, params)
    specs = f"feature:{head_dir}" if ssm == "feature" else [str(head_dir), tiny_pair[1], "ngram"]
    trees = tree if ssm == "feature" else [tree, "1,1", None]
    engine = Engine(tiny_pair[0], dtype="float32", ssm=specs, tree=trees, max_batch_size=2,
                    adaptive_tree=False)  # fmt: skip
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    accepted = sum(o.metrics["per_ssm"][0]["accepted"] for o in outs)
    assert accepted > 0  # the head's drafts were verified and some kept (6-token vocabulary)
    assert outs[0].metrics["per_ssm"][0]["name"] == f"feature:{head_dir.name}"


def test_a_cached_prefix_brings_its_features(tiny_pair, layered_head_dir):  # noqa: F811
    """Prefix caching with a feature head: a second turn takes the first turn's blocks, whose
    features (kept by block) are copied into its row, so the head reads the target's features
    at every slot as a teacher-forced forward has them; greedy output equals incremental."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine = Engine(tiny_pair[0], dtype="float32", ssm=f"feature:{layered_head_dir}",
                    tree="2,2,1", max_batch_size=1, adaptive_tree=False)  # fmt: skip
    assert engine.prefix_caching
    reference = Engine(tiny_pair[0], dtype="float32", prefix_caching=False)
    first = engine.generate([PROMPT], params)[0]
    engine.generate([[5, 0] * 12], params)  # another request's features in the row since
    second = PROMPT + first.token_ids + [1, 2, 3]
    out = engine.generate([second], params)[0]
    assert out.metrics["cached_tokens"] >= 16
    assert out.token_ids == reference.generate([second], params)[0].token_ids
    seq = second + out.token_ids[:-1]  # the tokens the target has run (or found cached)
    spec = engine.drafter.ssms[0]
    want = spec.model.reduce(_features_of(engine.model, seq, LAYERS))
    got = spec.features[0, 1 : len(seq) + 1]  # column s + 1: slot s
    assert torch.allclose(got.float(), want.float(), atol=1e-4)
    assert out.metrics["per_ssm"][0]["accepted"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: from replayed graphs
def test_the_served_head_reads_the_targets_layers(tiny_pair, layered_head_dir, dtype):  # noqa: F811
    # What the engine hands the head at each slot (prompt chunk, decode steps, verified paths)
    # is the target's features there, tapped layers included, as a teacher-forced forward has.
    engine = Engine(tiny_pair[0], dtype=dtype, ssm=f"feature:{layered_head_dir}",
                    tree="2,2,1", max_batch_size=1, adaptive_tree=False)  # fmt: skip
    out = engine.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.metrics["per_ssm"][0]["accepted"] > 0  # paths were verified, not only decodes
    if dtype == "bfloat16":
        from specinfer import ops

        assert engine.runner.graphs.replays > 0 or ops._C is None
    seq = PROMPT + out.token_ids[:-1]  # the tokens the target has run
    spec = engine.drafter.ssms[0]
    want = spec.model.reduce(_features_of(engine.model, seq, LAYERS))
    got = spec.features[0, 1 : len(seq) + 1]  # column s + 1: slot s
    assert torch.allclose(got.float(), want.float(), atol=1e-4)


def test_sampled_feature_head_matches_incremental_distribution(tiny_pair, head_dir, exact):  # noqa: F811
    engine = Engine(tiny_pair[0], dtype="float32", max_batch_size=512, ssm=str(head_dir),
                    tree=TreeConfig((3, 2), sample_children=True))  # fmt: skip
    stat, p = _chi_squared_p(_sample_first3(engine), exact, SAMPLES)
    print(f"\nfeature head, sampled children: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"


def test_training_a_head_reports_acceptance_and_exports(tmp_path, tiny_training):  # noqa: F811
    path, target, _ = tiny_training
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=8, top_k_logits=3, features=True)
    examples = make_teacher_data(engine, target, _prompts(16), settings, tmp_path / "teacher")
    train = TrainSettings(steps=30, lr=3e-3, batch_size=4)
    from specinfer.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper.from_path(path)
    report = train_feature_head(target, tok, examples, examples[:6], train, tmp_path, str(path))
    before, after = report["held_out_before"], report["held_out_after"]
    assert set(after) == {"depth1", "depth2", "depth3"}
    assert after["depth1"] > before["depth1"]  # trained on these very prompts
    assert after["depth1"] >= after["depth2"] >= after["depth3"]
    slots = sum(len(e["prompt"]) + len(e["completion"]) - 1 for e in examples)
    assert report["trained_slots"] == slots > report["teacher_tokens"]
    config = json.loads((tmp_path / "feature" / "config.json").read_text())
    assert config["architectures"] == ["SpecinferFeatureHead"]
    head = load_model(tmp_path / "feature", torch.float32, shared_embeddings_from=target)
    assert chain_acceptance(head, examples[:6]) == after  # the export is what was measured
    with pytest.raises(ValueError, match="without features"):
        train_feature_head(target, tok, [{"prompt": [1], "completion": [2]}], [], train,
                           tmp_path / "x", str(path))  # fmt: skip


def test_training_a_head_that_reads_layers(tmp_path, tiny_training):  # noqa: F811
    from specinfer.tokenizer import TokenizerWrapper

    path, target, _ = tiny_training
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=6, top_k_logits=3, features=True,
                               feature_layers=list(LAYERS))  # fmt: skip
    target.tap(LAYERS)  # as the pipeline does: the scorer hands the layers' inputs over
    try:
        examples = make_teacher_data(engine, target, _prompts(8), settings, tmp_path / "teacher")
    finally:
        target.tap(())  # the fixture's target is shared with other tests
    for e in examples:
        ids = e["prompt"] + e["completion"][:-1]
        want = _features_of(target, ids, LAYERS)
        assert torch.allclose(e["features"].float(), want, atol=1e-2)
    tok = TokenizerWrapper.from_path(path)
    train = TrainSettings(steps=10, lr=3e-3, batch_size=4)
    with pytest.raises(ValueError, match="features 16 wide"):  # data without the layers
        narrow = [{**e, "features": e["features"][:, -16:]} for e in examples]
        train_feature_head(target, tok, narrow, [], train, tmp_path / "x", str(path),
                           feature_layers=LAYERS)  # fmt: skip
    report = train_feature_head(target, tok, examples, examples[:3], train, tmp_path, str(path),
                                feature_layers=LAYERS)  # fmt: skip
    config = json.loads((tmp_path / "feature" / "config.json").read_text())
    assert config["feature_layers"] == list(LAYERS)
    head = load_model(tmp_path / "feature", torch.float32, shared_embeddings_from=target)
    assert head.config.feature_layers == LAYERS
    assert chain_acceptance(head, examples[:3]) == report["held_out_after"]
    with pytest.raises(ValueError, match="has layers 0..2"):
        build_head(target, feature_layers=(0, 3))


def test_teacher_data_from_before_feature_layers_still_resumes(tmp_path, tiny_training):  # noqa: F811
    path, target, _ = tiny_training
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=4, top_k_logits=3, features=True)
    first = make_teacher_data(engine, target, _prompts(2), settings, tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["feature_layers"]  # as written before the setting existed
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    again = make_teacher_data(engine, target, _prompts(2), settings, tmp_path)
    assert [e["completion"] for e in again] == [e["completion"] for e in first]
    with pytest.raises(ValueError, match="feature_layers"):
        make_teacher_data(engine, target, _prompts(2),
                          TeacherSettings(**{**vars(settings), "feature_layers": [1]}), tmp_path)  # fmt: skip


def test_drafters_draft_through_8_bit_copies_of_their_own_weights(tiny_pair, head_dir):  # noqa: F811
    """On the CPU model SSMs draft through int8 codes of their projections (ssm_int8, on by
    default there; test_greedy_feature_head_equals_incremental runs them): not the head's fc,
    whose input is raw hidden states, nor a layer-selected SSM's layers, which are the target's."""
    from specinfer.layers import Projection

    def coded(model) -> set[str]:
        return {
            n for n, m in model.named_modules() if isinstance(m, Projection) and m.codes is not None
        }

    engine = Engine(tiny_pair[0], dtype="float32", ssm=[str(head_dir), tiny_pair[1], "layers:1"])
    head, ssm, layers = engine.drafter.ssms
    assert coded(head.model) and head.model.fc.codes is None
    assert coded(ssm.model) == {
        n for n, m in ssm.model.named_modules() if isinstance(m, Projection)
    }
    assert not coded(layers.model) and not coded(engine.model)
    assert ssm.head_codes is not None or ssm.head_weight is None
    with pytest.raises(ValueError, match="shares the target's layers"):
        layers.quantize_int8()
    off = Engine(tiny_pair[0], dtype="float32", ssm=str(head_dir), ssm_int8=False)
    assert not coded(off.drafter.ssms[0].model)
    with pytest.raises(ValueError, match="ssm_int8 must be True, False or None"):
        Engine(tiny_pair[0], ssm=str(head_dir), ssm_int8="yes")


def test_feature_head_errors(tiny_pair, head_dir):  # noqa: F811
    with pytest.raises(ValueError, match="not a feature head"):
        Engine(tiny_pair[0], ssm=f"feature:{tiny_pair[1]}")
    with pytest.raises(ValueError, match="hidden states"):
        Engine(tiny_pair[0], ssm=str(head_dir), mode="dsi")
    with pytest.raises(ValueError, match="compact SSM"):
        load_model(head_dir)  # it has no embeddings of its own


def test_heads_reading_layers_the_target_lacks_or_other_layers_are_refused(
    tiny_pair,  # noqa: F811
    head_dir,
    layered_head_dir,
    tmp_path,
):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(layered_head_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["feature_layers"] = [0, 7]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 7\]"):
        Engine(tiny_pair[0], ssm=f"feature:{bad}")
    with pytest.raises(ValueError, match="same target layers"):
        Engine(tiny_pair[0], ssm=[str(layered_head_dir), str(head_dir)])
