"""SSM training (python/specinfer/training): prompt files, layer selection and pruning,
distillation, checkpoint/resume, export (our loader, HF transformers, the Engine), boosting."""

import json
import os
import signal

import pytest
import torch

from specinfer import Engine, SamplingParams
from specinfer.loader import load_model
from specinfer.tokenizer import TokenizerWrapper
from specinfer.training import distill as distill_module
from specinfer.training.boosting import boost
from specinfer.training.data import load_prompts, prompt_ids
from specinfer.training.distill import TrainSettings, distill
from specinfer.training.evaluate import (
    agreement_vectors,
    match_rule,
    target_tokens,
    topk_agreement,
)
from specinfer.training.export import export_student
from specinfer.training.recipe import SSMRecipe
from specinfer.training.scoring import completion_logits
from specinfer.training.student import build_student, parse_layers, train_forward
from specinfer.training.teacher import TeacherSettings, head_tokens, make_teacher_data

VOCAB = 24
CHAT = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"


def _tiny_target(path, seed=0, layers=3, vocab=VOCAB, silent_layers=()):
    """A random tied-embedding Llama (as SmolLM2) saved as an HF directory with a word-level
    tokenizer ("t0".."tN") and a chat template. `silent_layers` add nothing to the residual
    stream (zero output projections), so dropping them leaves the model's function unchanged."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for i in silent_layers:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    return path


def _prompts(n: int, vocab=VOCAB) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % vocab for j in range(2 + i % 5)] for i in range(n)]


def _prompt_file(tmp_path, n: int):
    """_prompts(n) as a text prompt file, one prompt a line."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(" ".join(f"t{t}" for t in p) for p in _prompts(n)))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target path, float32 target, teacher examples for 24 prompts x 8 tokens)."""
    root = tmp_path_factory.mktemp("training")
    path = _tiny_target(root / "target")
    engine = Engine(path, dtype="float32")
    # Students copy the target's layers: the weights as loaded, not the engine's packed ones.
    target = load_model(path, torch.float32)
    settings = TeacherSettings(str(path), max_new_tokens=8, top_k_logits=6, shard_size=10)
    examples = make_teacher_data(engine, target, _prompts(24), settings, root / "teacher")
    return path, target, examples


# -- prompt files -------------------------------------------------------------------------------


def test_prompt_files(tmp_path, tiny):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\n  \nsecond prompt\n")
    assert load_prompts(txt) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "t3 t4"}]
    jsonl.write_text(
        json.dumps({"prompt": "t5 t6"}) + "\n\n" + json.dumps({"messages": chat}) + "\n"
    )
    assert load_prompts(jsonl) == ["t5 t6", chat]
    tokenizer = TokenizerWrapper.from_path(tiny[0])
    assert prompt_ids(tokenizer, "t5 t6", chat=False) == [5, 6]
    assert prompt_ids(tokenizer, "t5 t6", chat=True) == [1, 5, 6, 2]  # through the template
    assert prompt_ids(tokenizer, chat, chat=False) == [1, 3, 4, 2]  # messages: always


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.txt", "\n \n", "has no prompts"),
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', "bad.jsonl, line 2: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", "line 1: expected a JSON object"),
        ("field.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n', "line 3: needs a non-empty 'prompt'"),
        ("msgs.jsonl", '{"messages": [{"role": "user"}]}\n', "line 1: each message needs"),
        ("p.csv", "a\n", "must be .txt"),
    ],
)
def test_prompt_file_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_prompts(tmp_path / name)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.txt")


def test_teacher_data_resumes_and_checks_settings(tmp_path, tiny):
    path, target, _ = tiny
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=5, top_k_logits=3, shard_size=4)
    prompts = _prompts(6)
    first = make_teacher_data(engine, engine.model, prompts, settings, tmp_path)
    assert [len(e["completion"]) for e in first] == [5] * 6
    assert all(e["topk_ids"].shape == (5, 3) for e in first)
    (tmp_path / "shard_00001.pt").unlink()  # as if interrupted while making the second shard
    generated = []
    real_generate = engine.generate
    engine.generate = lambda p, params: generated.extend(p) or real_generate(p, params)
    again = make_teacher_data(engine, engine.model, prompts, settings, tmp_path)
    assert generated == prompts[4:]
    assert [e["completion"] for e in again] == [e["completion"] for e in first]
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens, top_k_logits differ"):
        make_teacher_data(
            engine, engine.model, prompts, TeacherSettings(str(path), shard_size=4), tmp_path
        )


def test_teacher_data_rescores_an_earlier_runs_completions(tmp_path, tiny):
    path, target, _ = tiny
    engine = Engine(path, dtype="float32")
    prompts = _prompts(6)
    plain = TeacherSettings(str(path), max_new_tokens=5, top_k_logits=3, shard_size=4)
    first = make_teacher_data(engine, target, prompts, plain, tmp_path / "a")
    engine.generate = None  # re-scoring must not generate
    wider = TeacherSettings(str(path), max_new_tokens=5, top_k_logits=5, shard_size=4,
                            features=True)  # fmt: skip
    again = make_teacher_data(engine, target, prompts, wider, tmp_path / "b",
                              completions_from=tmp_path / "a")  # fmt: skip
    assert [e["completion"] for e in again] == [e["completion"] for e in first]
    assert all(e["topk_ids"].shape == (5, 5) and "features" in e for e in again)
    for e, old in zip(again, first):  # the same scorer: the top 3 of 5 are the top 3
        assert torch.equal(e["topk_ids"][:, :3], old["topk_ids"])
    longer = TeacherSettings(str(path), max_new_tokens=6, top_k_logits=5, shard_size=4)
    with pytest.raises(ValueError, match=r"generated otherwise \(max_new_tokens differ\)"):
        make_teacher_data(engine, target, prompts, longer, tmp_path / "c",
                          completions_from=tmp_path / "a")  # fmt: skip
    (tmp_path / "a" / "shard_00001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks shard_00001.pt"):
        make_teacher_data(engine, target, prompts, wider, tmp_path / "d",
                          completions_from=tmp_path / "a")  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no teacher data"):
        make_teacher_data(engine, target, prompts, wider, tmp_path / "e",
                          completions_from=tmp_path / "nothing")  # fmt: skip


# -- the student --------------------------------------------------------------------------------


def test_parse_layers():
    assert parse_layers("first:2", 30) == [0, 1]
    assert parse_layers("29,0,1", 30) == [0, 1, 29]
    for spec, message in [("first:30", "1 <= N < 30"), ("first:0", "1 <= N < 30"),
                          ("0,30", r"\[30\] out of range"), ("-1", "out of range"),
                          ("a,b", "first:N or a comma list"), ("0,1,2", "no smaller model")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_layers(spec, 3 if spec == "0,1,2" else 30)


def test_pruned_student_is_consistent(tiny):
    _, target, examples = tiny
    student = build_student(target, [0, 2], mlp_keep=0.5)
    assert student.config.num_layers == 2 and student.config.intermediate_size == 32
    assert student.model.embed_tokens.weight is target.model.embed_tokens.weight  # shared
    mlp, source = student.model.layers[1].mlp, target.model.layers[2].mlp
    assert mlp.gate_up_proj.weight.shape == (64, 32) and mlp.down_proj.weight.shape == (32, 32)
    # each kept channel is an original channel: its gate row, up row and down column together
    gate, up = source.gate_up_proj.weight.chunk(2)
    for row in range(32):
        match = (gate == mlp.gate_up_proj.weight[row]).all(-1).nonzero()
        (channel,) = match[:, 0].tolist()
        assert torch.equal(up[channel], mlp.gate_up_proj.weight[32 + row])
        assert torch.equal(source.down_proj.weight[:, channel], mlp.down_proj.weight[:, row])
    # the differentiable training forward computes what the inference forward computes
    seqs = [(e["prompt"], e["completion"]) for e in examples[:3]]
    for (p, c), logits in zip(seqs, completion_logits(student, seqs)):
        hidden = train_forward(student, torch.tensor([p + c[:-1]]))[0, len(p) - 1 :]
        torch.testing.assert_close(student.compute_logits(hidden), logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="mlp_keep"):
        build_student(target, [0], mlp_keep=0.0)


# -- distillation -------------------------------------------------------------------------------


def _mean_loss(student, examples, kind="kl"):
    with torch.no_grad():
        return distill_module._loss(student, examples, kind, None)[0].item()


@pytest.mark.parametrize("kind, vocab", [("kl", 0), ("ce", 0), ("kl", 6)])
def test_training_reduces_loss(tmp_path, tiny, kind, vocab):
    _, target, examples = tiny
    student = build_student(target, [0])
    before = _mean_loss(student, examples, kind)
    settings = TrainSettings(loss=kind, steps=25, lr=3e-3, batch_size=6, loss_vocab=vocab)
    losses = distill(student, examples, settings, tmp_path / "ck.pt")
    assert len(losses) == 25
    assert _mean_loss(student, examples, kind) < 0.8 * before


def test_checkpoint_resume_equals_uninterrupted(tmp_path, tiny, monkeypatch):
    _, target, examples = tiny
    settings = TrainSettings(steps=6, lr=3e-3, batch_size=5, checkpoint_every=4)
    reference = build_student(target, [1])
    distill(reference, examples, settings, tmp_path / "a.pt")

    # Ctrl-C during step 3: the step finishes, a checkpoint is saved, training stops.
    real_loss, calls = distill_module._loss, []

    def interrupted_loss(*args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*args)

    monkeypatch.setattr(distill_module, "_loss", interrupted_loss)
    student = build_student(target, [1])
    with pytest.raises(KeyboardInterrupt, match="stopped at step 3/6"):
        distill(student, examples, settings, tmp_path / "b.pt")
    assert torch.load(tmp_path / "b.pt", weights_only=True)["step"] == 3
    monkeypatch.setattr(distill_module, "_loss", real_loss)

    resumed = build_student(target, [1])  # a fresh process would start from scratch like this
    losses = distill(resumed, examples, settings, tmp_path / "b.pt")
    assert len(losses) == 6
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other settings"):
        distill(resumed, examples, TrainSettings(steps=7), tmp_path / "b.pt")


# -- export -------------------------------------------------------------------------------------


def test_export_loads_in_our_loader_hf_and_engine(tmp_path, tiny):
    transformers = pytest.importorskip("transformers")
    path, target, examples = tiny
    student = build_student(target, [0, 2], mlp_keep=0.75)
    distill(student, examples, TrainSettings(steps=3, lr=1e-2), tmp_path / "ck.pt")
    head = head_tokens(examples)
    tokenizer = TokenizerWrapper.from_path(path)
    out = export_student(student, tmp_path / "ssm", tokenizer, head, {"source_layers": [0, 2]})
    assert json.loads((out / "head_tokens.json").read_text())["tokens"] == head
    ids = [3, 7, 1, 9, 4, 4, 2]
    T = len(ids)
    ours = load_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    kv, mask = ours.make_kv_cache(1, T), torch.ones(1, T, T, dtype=torch.bool).tril()
    hidden = ours(torch.tensor([ids]), torch.arange(T)[None], kv, torch.tensor([0]),
                  torch.tensor([0]), mask)  # fmt: skip
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        trained = student.compute_logits(train_forward(student, torch.tensor([ids]))[0])
    torch.testing.assert_close(ours.compute_logits(hidden[0]), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(trained, expected, atol=1e-4, rtol=0)
    assert TokenizerWrapper.from_path(out).encode("t3 t7") == [3, 7]

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[3, 7, 1], [5]]
    incremental = Engine(path, dtype="float32").generate(prompts, params)
    for ssm in (
        out,
        export_student(student, tmp_path / "compact", tokenizer, head, {}, compact=True),
    ):
        spec = Engine(path, dtype="float32", ssm=ssm, tree="1,2,1")
        assert [o.token_ids for o in spec.generate(prompts, params)] == [
            o.token_ids for o in incremental
        ]
    compact = load_model(tmp_path / "compact", shared_embeddings_from=target)
    assert compact.model.embed_tokens.weight is target.model.embed_tokens.weight  # no copy
    assert "model.embed_tokens.weight" not in _safetensor_names(tmp_path / "compact")
    with pytest.raises(ValueError, match="compact SSM without embeddings"):
        load_model(tmp_path / "compact")


def _safetensor_names(directory):
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def test_vocabulary_mismatch(tmp_path, tiny):
    path, target, _ = tiny
    other = _tiny_target(tmp_path / "other", vocab=VOCAB + 8)
    tokenizer = TokenizerWrapper.from_path(path)
    student = build_student(target, [0])
    for compact, message in ((False, "vocabulary size 24.*has 32"), (True, "vocabulary size 24")):
        ssm = export_student(student, tmp_path / f"ssm{compact}", tokenizer, [], {}, compact)
        with pytest.raises(ValueError, match=message):
            Engine(other, dtype="float32", ssm=ssm)


# -- boosting -----------------------------------------------------------------------------------


def test_match_rules():
    agree = torch.tensor([True, True, False, True])
    assert not match_rule("identical")(agree) and match_rule("identical")(agree[:2])
    assert match_rule("prefix:2")(agree) and not match_rule("prefix:3")(agree)
    assert match_rule("agree:0.75")(agree) and not match_rule("agree:0.8")(agree)
    for bad in ("prefix:0", "agree:0", "agree:1.5", "prefix:x", "identical:3", "same"):
        with pytest.raises(ValueError, match="match rule"):
            match_rule(bad)


def test_boosting_removes_covered_prompts(tmp_path):
    """A target whose last layer is silent: its first layer alone computes the same function,
    so the first SSM covers every prompt and boosting stops after one stage."""
    path = _tiny_target(tmp_path / "target", layers=2, silent_layers=[1])
    engine = Engine(path, dtype="float32")
    settings = TeacherSettings(str(path), max_new_tokens=6, top_k_logits=4)
    examples = make_teacher_data(engine, engine.model, _prompts(10), settings, tmp_path / "teacher")
    target = load_model(path)
    tokenizer = TokenizerWrapper.from_path(path)
    exact = SSMRecipe(
        target, tokenizer, [0], TrainSettings(steps=1, lr=1e-12), head_tokens(examples)
    )
    report = boost(exact, examples, examples[:4], 3, "identical", tmp_path / "exact")
    (stage,) = report["ssms"]
    assert stage["covered"] == 10 and stage["coverage"] == 1.0
    assert stage["held_out_coverage"] == 1.0 and stage["held_out_agreement"]["top1"] == 1.0
    assert not (tmp_path / "exact" / "ssm_2").exists()
    seqs = [(e["prompt"], e["completion"]) for e in examples]
    table = topk_agreement(exact.untrained(), seqs, target_tokens(target, seqs))
    assert table["greedy"] == {"top1": 1.0, "top3": 1.0, "top5": 1.0}
    assert 0 < table["stochastic"]["top1"] <= table["stochastic"]["top5"] <= 1

    # An SSM that gets nothing right leaves every prompt to the next stage.
    wrong = SSMRecipe(
        target, tokenizer, [1], TrainSettings(steps=1, lr=1e-12), head_tokens(examples)
    )
    vectors = agreement_vectors(
        wrong.untrained(), [(e["prompt"], e["completion"]) for e in examples]
    )
    report = boost(wrong, examples, [], 2, "identical", tmp_path / "wrong")
    first, second = report["ssms"]
    assert first["covered"] == sum(bool(v.all()) for v in vectors)
    assert second["trained_on"] == 10 - first["covered"]


# -- the command line ---------------------------------------------------------------------------


def test_cli_train_ssm(tmp_path, tiny, capsys):
    from specinfer.cli import main

    path = tiny[0]
    prompts = _prompt_file(tmp_path, 12)
    args = ["train-ssm", "--prompts", str(prompts), "--held-out", str(prompts), "--model",
            str(path), "--out", str(tmp_path / "out"), "--layers", "0", "--steps", "2",
            "--max-new-tokens", "4", "--boost", "2", "--match", "prefix:1",
            "--independent", "split", "--compact", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["train_prompts"] == 12 and report["teacher_tokens"] == 48
    assert set(report["held_out_before"]) == {"top1", "top3", "top5"}
    assert len(report["independent"]["ssms"]) == 2
    first = report["boosting"]["ssms"][0]
    assert first["trained_on"] == 12 and (tmp_path / "out" / "ssm_1" / "config.json").exists()
    assert not list((tmp_path / "out").glob("checkpoint*.pt"))  # finished work is exported
    capsys.readouterr()
    assert main(args) == 0  # a re-run reuses everything
    err = capsys.readouterr().err
    assert "already trained" in err
    assert "ssm_1: coverage" in err and "independent_2: held-out coverage" in err  # progress bars
    bad = ["train-ssm", "--prompts", str(prompts), "--model", str(path), "--layers", "0,3",
           "--out", str(tmp_path / "bad"), "--max-new-tokens", "2"]  # fmt: skip
    assert main(bad) == 2
    assert "layers [3] out of range" in capsys.readouterr().err


def test_sampled_teacher_data_keeps_held_out_completions_greedy(tmp_path, tiny):
    from specinfer.training import TrainSettings, train_ssm

    path = tiny[0]
    prompts = _prompt_file(tmp_path, 12)
    train_ssm(prompts, tmp_path / "out", model=path, layers="0", held_out=prompts,
              max_new_tokens=6, temperature=1.5, dtype="float32",
              settings=TrainSettings(steps=1))  # fmt: skip
    meta = {d: json.loads((tmp_path / "out" / d / "meta.json").read_text())
            for d in ("teacher", "teacher_held_out")}  # fmt: skip
    assert meta["teacher"]["temperature"] == 1.5 and meta["teacher_held_out"]["temperature"] == 0
    engine = Engine(path, dtype="float32")
    encoded = [prompt_ids(engine.tokenizer, p, True) for p in load_prompts(prompts)]
    greedy = [o.token_ids for o in engine.generate(encoded, SamplingParams(max_tokens=6))]
    shards = sorted((tmp_path / "out").glob("teacher*/shard_*.pt"))
    by_dir = {}
    for f in shards:
        by_dir.setdefault(f.parent.name, []).extend(torch.load(f, weights_only=True))
    held = [e["completion"] for e in by_dir["teacher_held_out"]]
    sampled = [e["completion"] for e in by_dir["teacher"]]
    assert held == greedy and sampled != greedy  # same prompts: only the training data samples


def test_train_ssm_reuses_an_earlier_runs_completions(tmp_path, tiny, monkeypatch):
    from specinfer.training import TrainSettings, train_ssm

    path = tiny[0]
    prompts = _prompt_file(tmp_path, 6)
    common = dict(model=path, layers="0", held_out=prompts, max_new_tokens=4,
                  settings=TrainSettings(steps=1))  # fmt: skip
    train_ssm(prompts, tmp_path / "a", **common)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(Engine, "generate", no_generation)
    train_ssm(prompts, tmp_path / "b", top_k_logits=4, completions_from=tmp_path / "a", **common)
    for name in ("teacher", "teacher_held_out"):
        a, b = (torch.load(tmp_path / d / name / "shard_00000.pt", weights_only=True)
                for d in ("a", "b"))  # fmt: skip
        assert [e["completion"] for e in a] == [e["completion"] for e in b]
        assert b[0]["topk_ids"].shape[1] == 4 != a[0]["topk_ids"].shape[1]
    with pytest.raises(FileNotFoundError, match="no teacher data in"):
        train_ssm(prompts, tmp_path / "c", completions_from=tmp_path / "x", **common)
    assert not (tmp_path / "c").exists()  # refused before any work
