"""Repetition, presence and frequency penalties: their definitions (HF's and the OpenAI API's),
and speculation that stays exact with them on (greedy token-identical to incremental decoding,
sampling chi-squared against the exact penalised incremental distribution)."""

import pytest
import torch

from specinfer import Engine, SamplingParams
from specinfer.sampling import Penalties
from specinfer.tree import TokenTree, TreeConfig
from test_budget import SteepCosts
from test_speculative import PROMPT, VOCAB, _chi_squared_p, _last_logits, tiny_pair  # noqa: F401

PENALTIES = {"repetition_penalty": 1.4, "presence_penalty": 0.6, "frequency_penalty": 0.4}


def _reference(logits, prompt, output, repetition=1.0, presence=0.0, frequency=0.0):
    """The definitions, one token at a time: HF's repetition penalty over prompt + output,
    then the OpenAI API's presence and frequency penalties over the output."""
    out = logits.double().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_penalties_follow_their_definitions():
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(V) * 3
    prompt, output = [1, 2, 3, 3, 7], [3, 9, 9, 9, 12, 1]
    params = SamplingParams(**PENALTIES)
    ours = Penalties(params, prompt, V).apply(logits[None], output)[0]
    expected = _reference(logits, prompt, output, 1.4, 0.6, 0.4)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, logits), "penalties changed nothing"
    transformers = pytest.importorskip("transformers")
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.4)
    hf_out = hf(torch.tensor([prompt + output]), logits[None].clone())[0]
    only_rep = Penalties(SamplingParams(repetition_penalty=1.4), prompt, V).apply(
        logits[None], output
    )
    torch.testing.assert_close(only_rep[0], hf_out)


def test_no_penalty_leaves_logits_alone():
    logits = torch.randn(3, 10)
    assert Penalties(SamplingParams(), [1], 10).apply(logits, [2, 3], [[4], [5], []]) is logits


def test_each_branch_is_penalised_as_its_own_sequence():
    """Row i after output + branches[i], restricted to a head subset, equals the full
    penalised logits of output + branches[i] at those columns."""
    torch.manual_seed(1)
    V, params = 20, SamplingParams(**PENALTIES)
    pen = Penalties(params, [0, 5], V)
    branches = [[], [4], [4, 4], [6, 5]]
    logits = torch.randn(len(branches), V)
    rows = pen.apply(logits, [5, 8], branches)
    for i, branch in enumerate(branches):
        alone = pen.apply(logits[i : i + 1], [5, 8] + branch)[0]
        assert torch.equal(rows[i], alone)
    head = torch.tensor([4, 5, 19, 0])
    sub = pen.apply(logits[:, head], [5, 8], branches, head)
    assert torch.equal(sub, rows[:, head])


def _dense(logits, prompt, output, branches, params, V, vocab_ids=None):
    """The penalties over every column of every row (what apply computes on held columns)."""
    counts = torch.bincount(torch.tensor(output), minlength=V).float().expand(len(branches), -1)
    counts = counts.clone()
    for i, branch in enumerate(branches):
        for t in branch:
            counts[i, t] += 1
    seen = torch.zeros(V, dtype=torch.bool)
    seen[torch.tensor(prompt)] = True
    seen = seen | (counts > 0)
    if vocab_ids is not None:
        counts, seen = counts[:, vocab_ids], seen[:, vocab_ids]
    x = logits.float()
    scaled = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    x = torch.where(seen, scaled, x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalised_columns_alone_give_the_dense_result_bit_for_bit(dtype):
    """apply computes only the columns of held tokens: the same values, bit for bit, as the
    whole rows, with a restricted vocabulary too; the caller's logits stay as they were."""
    torch.manual_seed(2)
    V, params = 300, SamplingParams(**PENALTIES)
    prompt, output = [3, 3, 17, 250], [17, 40, 40, 299]
    branches = [[], [40], [40, 7], [7, 7, 120], [299]]
    logits = (torch.randn(len(branches), V) * 4).to(dtype)
    before = logits.clone()
    pen = Penalties(params, prompt, V)
    ours = pen.apply(logits, output, branches)
    assert ours.dtype == torch.float32 and torch.equal(logits, before)
    assert torch.equal(ours, _dense(logits, prompt, output, branches, params, V))
    head = torch.tensor([299, 7, 0, 17, 1])  # 120, 40 and 250 outside it
    sub = pen.apply(logits[:, head], output, branches, head)
    assert torch.equal(sub, _dense(logits[:, head], prompt, output, branches, params, V, head))
    assert torch.equal(sub, ours[:, head])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(**PENALTIES), SamplingParams(repetition_penalty=0.8),
     SamplingParams(presence_penalty=-0.5), SamplingParams(frequency_penalty=1.3)],
    ids=["all", "repetition", "presence", "frequency"],
)  # fmt: skip
def test_the_compiled_penalties_equal_the_torch_path(params):
    """On the CPU apply runs a kernel; apply_reference (torch, any device) defines it. Random
    requests over a real-sized vocabulary: prompt, output and branch tokens that repeat and
    overlap, a restricted head in any order (held tokens in and out of it), bf16 and float32."""
    ops = pytest.importorskip("specinfer.ops")
    if ops._C is None:
        pytest.skip("no compiled core")
    g = torch.Generator().manual_seed(3)
    V = 49152
    for case in range(6):
        pool = torch.randint(0, V, (60,), generator=g)  # few tokens: they repeat

        def pick(n: int, pool=pool) -> list[int]:
            return pool[torch.randint(0, 60, (n,), generator=g)].tolist()

        prompt, output = pick(40), pick(int(torch.randint(0, 30, (1,), generator=g)))
        branches = [pick(d) for d in range(int(torch.randint(0, 6, (1,), generator=g)))]
        rows = max(1, len(branches))
        dtype = (torch.float32, torch.bfloat16)[case % 2]
        logits = (torch.randn(rows, V, generator=g) * 5).to(dtype)
        pen = Penalties(params, prompt, V)
        ours = pen.apply(logits, output, branches)
        assert torch.equal(ours, pen.apply_reference(logits, output, branches)), case
        assert not torch.equal(ours, logits.float()), "penalties changed nothing"
        head = torch.cat([pool[:20].unique(), torch.randperm(V, generator=g)[:500]])
        head = head[torch.randperm(len(head), generator=g)]
        sub = pen.apply(logits[:, head], output, branches, head)
        assert torch.equal(sub, pen.apply_reference(logits[:, head], output, branches, head))
        assert torch.equal(sub, ours[:, head])


@pytest.mark.parametrize("extra", [{}, PENALTIES], ids=["bias alone", "after penalties"])
def test_the_logit_bias_is_added_after_the_penalties(extra):
    V, prompt, output, branches = 300, [3, 9, 120], [9, 250, 9], [[], [7], [7, 120]]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 4
    bias = {7: -100, 120: 2.5, 299: 0.75}
    pen = Penalties(SamplingParams(logit_bias=bias, **extra), prompt, V)
    want = Penalties(SamplingParams(**extra), prompt, V).apply(logits, output, branches).clone()
    for t, b in bias.items():
        want[:, t] += b
    ours = pen.apply(logits, output, branches)
    assert torch.equal(ours, want) and torch.equal(
        ours, pen.apply_reference(logits, output, branches)
    )
    head = torch.tensor([299, 7, 0, 17, 1])  # 120 outside it
    assert torch.equal(pen.apply(logits[:, head], output, branches, head), want[:, head])
    assert torch.equal(logits, torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 4)
    with pytest.raises(ValueError, match="logit_bias: token ids outside the vocabulary of 300"):
        Penalties(SamplingParams(logit_bias={300: 1.0}), prompt, V)
    with pytest.raises(ValueError, match=r"logit_bias must map token ids .* \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})


def test_penalties_refuse_tokens_outside_the_vocabulary():
    pen = Penalties(SamplingParams(**PENALTIES), [1, 2], 10)
    with pytest.raises(ValueError, match="token 10 in the output is outside the vocabulary"):
        pen.apply(torch.zeros(1, 10), [3, 10])
    with pytest.raises(ValueError, match=r"vocab_ids\[1\] = -1 is outside the vocabulary"):
        pen.apply(torch.zeros(1, 2), [3], None, torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="branches has 1 entries for 2 rows"):
        pen.apply(torch.zeros(2, 10), [3], [[4]])


def test_tree_branches_are_root_to_node_tokens():
    tree = TokenTree(7)
    a = tree.propose(0, 1)
    b = tree.propose(a, 2)
    c = tree.propose(0, 3)
    assert tree.branches() == [[], [1], [1, 2], [3]]
    assert tree.branches([b, c]) == [[1, 2], [3]]


@pytest.mark.parametrize("bad", [{"repetition_penalty": 0}, {"presence_penalty": 2.5},
                                 {"frequency_penalty": -3}, {"repetition_penalty": float("inf")}])  # fmt: skip
def test_bad_penalties_are_rejected(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


# -- greedy: token-identical with penalties ------------------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize(
    "ssm, tree",
    [("other", "2,2,1"), (["other", "ngram:max_n=2,depth=4,branches=2"], ["1,3,1", None]), (1, "3,1,1")],
)  # fmt: skip
def test_greedy_with_penalties_equals_incremental(tiny_pair, ssm, tree, adaptive):  # noqa: F811
    target, other = tiny_pair
    ssm = [other if s == "other" else s for s in ssm] if isinstance(ssm, list) else ssm
    ssm = other if ssm == "other" else ssm
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, **PENALTIES)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    plain = Engine(target, dtype="float32").generate(prompts, SamplingParams(24, ignore_eos=True))
    assert [r.token_ids for r in reference] != [p.token_ids for p in plain], "penalties inert"
    spec = Engine(target, dtype="float32", ssm=ssm, tree=tree, max_batch_size=3,
                  adaptive_tree=adaptive)  # fmt: skip
    if adaptive:
        # Rows nearly free: low-value nodes go, likely ones stay, whatever the machine's timings.
        spec.budget = SteepCosts(steepness=0.005)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    # Any request's accepted drafts test the penalised verification (the cut, pricing this
    # unrelated SSM's drafts by their learned low rates, may leave one request none).
    assert any(o.metrics["accepted_per_depth"] for o in outs), (
        "nothing accepted: speculation untested"
    )
    assert not adaptive or spec.budget.cut > 0, "nothing was cut: the cut untested"


def test_a_tree_batch_mixing_penalised_and_plain_greedy_requests_equals_incremental(tiny_pair):  # noqa: F811
    """Plain greedy rows take their tokens from one max over the batch; penalised rows in the
    same step must still be verified on their penalised logits."""
    target, other = tiny_pair
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **(PENALTIES if i % 2 else {}))
              for i in range(len(prompts))]  # fmt: skip
    reference = Engine(target, dtype="float32").generate(prompts, params)
    spec = Engine(target, dtype="float32", ssm=other, tree="2,2,1", max_batch_size=4,
                  adaptive_tree=False)  # fmt: skip
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert all(o.metrics["accepted_per_depth"] for o in outs[:2]), "speculation untested"


def test_greedy_with_a_logit_bias_equals_incremental(tiny_pair):  # noqa: F811
    """The bias alone and after the penalties: banned tokens never come, the outputs change,
    and speculation (drafts biased too, a restricted SSM head) equals incremental decoding."""
    target, other = tiny_pair
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    for extra in ({}, PENALTIES):
        plain = SamplingParams(max_tokens=24, ignore_eos=True, **extra)
        params = SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=BIAS, **extra)
        reference = Engine(target, dtype="float32").generate(prompts, params)
        unbiased = Engine(target, dtype="float32").generate(prompts, plain)
        assert [r.token_ids for r in reference] != [u.token_ids for u in unbiased], "bias inert"
        assert not any(0 in r.token_ids for r in reference)
        spec = Engine(target, dtype="float32", ssm=[other, "ngram"], tree=["2,2,1", None],
                      ssm_head=4, adaptive_tree=False)  # fmt: skip
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], extra
        assert any(o.metrics["accepted_per_depth"] for o in outs), "speculation untested"


def test_greedy_check_detects_penalties_ignoring_the_node_path(tiny_pair, monkeypatch):  # noqa: F811
    """A verifier that penalises every node by the committed output alone (not its own path)
    diverges from incremental decoding: the test above can fail."""
    target, other = tiny_pair
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, **PENALTIES)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    real_apply = Penalties.apply
    monkeypatch.setattr(Penalties, "apply",
                        lambda self, lg, out, branches=None, vocab_ids=None:
                        real_apply(self, lg, out, None, vocab_ids))  # fmt: skip
    spec = Engine(target, dtype="float32", ssm=target, tree="2,2,1", adaptive_tree=False)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] != [r.token_ids for r in reference]


# -- sampling: the penalised target distribution ------------------------------------------------

SAMPLES = 20_000
TEMPERATURE = 0.8


BIAS = {0: -100, 3: 1.5}  # token 0 banned, token 3 favoured


def _exact(tiny_pair, bias: dict) -> dict[tuple, float]:  # noqa: F811
    """P(first 3 tokens) under incremental sampling with PENALTIES (and `bias` added after
    them), from the target's logits penalised by the reference definitions above."""
    model = Engine(tiny_pair[0], dtype="float32").model
    probs = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for prefix, p in probs.items():
            raw = _last_logits(model, PROMPT + list(prefix))
            logits = _reference(raw, PROMPT, list(prefix), 1.4, 0.6, 0.4)
            for t, b in bias.items():
                logits[t] += b
            dist = torch.softmax(logits / TEMPERATURE, -1)
            for t in range(VOCAB):
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


@pytest.fixture(scope="module")
def exact_penalised(tiny_pair):  # noqa: F811
    return _exact(tiny_pair, {})


def _sample_first3(engine: Engine, n: int, bias: dict | None = None) -> dict[tuple, int]:
    params = [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, temperature=TEMPERATURE,
                             logit_bias=bias, **PENALTIES) for s in range(n)]  # fmt: skip
    counts: dict[tuple, int] = {}
    for o in engine.generate([PROMPT] * n, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("incremental", {}),
        ("sampled children", {"tree": TreeConfig((3, 2), sample_children=True)}),
        ("top-k children", {"tree": TreeConfig((2, 2))}),
        ("merged with ngram", {"ssm": ["other", "ngram:max_n=1,depth=3,branches=2"],
                               "tree": [TreeConfig((3, 2), sample_children=True), None]}),
    ],
)  # fmt: skip
def test_sampling_with_penalties_matches_incremental(tiny_pair, exact_penalised, name, kwargs):  # noqa: F811
    target, other = tiny_pair
    if kwargs:
        ssm = kwargs.get("ssm", other)
        ssm = [other if s == "other" else s for s in ssm] if isinstance(ssm, list) else ssm
        kwargs = {**kwargs, "ssm": ssm}
    engine = Engine(target, dtype="float32", max_batch_size=512, **kwargs)
    stat, p = _chi_squared_p(_sample_first3(engine, SAMPLES), exact_penalised, SAMPLES)
    print(f"\npenalties, {name}: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"{name}: chi2 = {stat:.1f}, p = {p:.2e}"


def test_sampling_with_a_logit_bias_matches_incremental(tiny_pair):  # noqa: F811
    """Sampled children drafted and verified with the bias added after the penalties."""
    target, other = tiny_pair
    exact = _exact(tiny_pair, BIAS)
    engine = Engine(target, dtype="float32", max_batch_size=512, ssm=other,
                    tree=TreeConfig((3, 2), sample_children=True))  # fmt: skip
    counts = _sample_first3(engine, SAMPLES, BIAS)
    assert not any(0 in key for key in counts), "a banned token was sampled"
    stat, p = _chi_squared_p(counts, exact, SAMPLES)
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"
    stat, p = _chi_squared_p(counts, _exact(tiny_pair, {}), SAMPLES)
    assert p < 1e-6, "the bias made no difference the test can see"


@pytest.mark.parametrize("tree", [TreeConfig((3, 2), sample_children=True), TreeConfig((2, 2))],
                         ids=["sampled children", "top-k children"])  # fmt: skip
def test_sampling_with_min_tokens_matches_incremental(tiny_pair, tree):  # noqa: F811
    """min_tokens 2 with a stop token id: masked in the first two positions only (each tree node
    by its own depth), chi-squared against the joint computed here from the raw logits."""
    target, other = tiny_pair
    model = Engine(target, dtype="float32").model
    stop = int(_last_logits(model, PROMPT).argmax())  # the likeliest first token
    probs: dict[tuple, float] = {(): 1.0}
    for depth in range(3):
        nxt = {}
        for prefix, p in probs.items():
            logits = _last_logits(model, PROMPT + list(prefix))
            if depth < 2:
                logits[stop] = float("-inf")
            dist = torch.softmax(logits / TEMPERATURE, -1)
            for t in range(VOCAB):
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    engine = Engine(target, dtype="float32", max_batch_size=512, ssm=other, tree=tree)
    params = [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, temperature=TEMPERATURE,
                             min_tokens=2, stop_token_ids=[stop]) for s in range(SAMPLES)]  # fmt: skip
    counts: dict[tuple, int] = {}
    for o in engine.generate([PROMPT] * SAMPLES, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert not any(stop in key[:2] for key in counts), "the stop token came before min_tokens"
    stat, p = _chi_squared_p(counts, probs, SAMPLES)
    print(f"\nmin_tokens, {tree}: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"


def test_the_test_detects_an_unpenalised_proposal_distribution(tiny_pair, exact_penalised,  # noqa: F811
                                                               monkeypatch):  # fmt: skip
    """Children drawn from the penalised SSM distribution but verified against the unpenalised
    one: biased, and detected."""
    from specinfer.speculator import Speculator

    real_expand = Speculator._expand
    unpenalised = {}

    def expand(self, tree, nodes, logits, width, params, generator, paths):
        start = len(tree.q_rows)
        real_expand(self, tree, nodes, logits, width, params, generator, paths)
        for i, row in enumerate(range(start, len(tree.q_rows))):
            tree.q_rows[row] = unpenalised["q"][i]

    real_apply = Penalties.apply

    def apply(self, logits, output_ids, branches=None, vocab_ids=None):
        if branches is not None and logits.shape[0] == len(branches) and vocab_ids is None:
            from specinfer.sampling import probabilities

            unpenalised["q"] = probabilities(logits, TEMPERATURE)  # the SSM's raw distribution
        return real_apply(self, logits, output_ids, branches, vocab_ids)

    monkeypatch.setattr(Speculator, "_expand", expand)
    monkeypatch.setattr(Penalties, "apply", apply)
    engine = Engine(tiny_pair[0], dtype="float32", max_batch_size=512, ssm=tiny_pair[1],
                    tree=TreeConfig((3, 3), sample_children=True))  # fmt: skip
    stat, p = _chi_squared_p(_sample_first3(engine, 5_000), exact_penalised, 5_000)
    print(f"\nunpenalised q: chi2 = {stat:.1f}, p = {p:.2e}")
    assert p < 1e-3, f"an unpenalised q should be detected: chi2 = {stat:.1f}, p = {p:.3f}"


# -- SmolLM2 --------------------------------------------------------------------------------------


def _smollm_prompts(n: int) -> list:
    from test_generation_vs_hf import CHATS, WRITTEN, _stdlib_prompts

    return (WRITTEN + CHATS + _stdlib_prompts(10))[:n]


@pytest.mark.parametrize("n, tokens", [(4, 32), pytest.param(20, 64, marks=pytest.mark.slow)])
def test_smollm_greedy_with_penalties_is_bit_exact(smollm_gguf, n, tokens):
    """bfloat16 (bit-exact by construction, no near-tie allowance), the shipped SSM merged with
    prompt lookup: what `specinfer generate` runs, with penalties, but whole trees: at batch 4
    the cost-aware cut may drop most nodes on a CPU, which would leave little to verify."""
    prompts = _smollm_prompts(n)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, repetition_penalty=1.1,
                            presence_penalty=0.3, frequency_penalty=0.2)  # fmt: skip
    reference = Engine(smollm_gguf, dtype="bfloat16", max_batch_size=4).generate(prompts, params)
    spec = Engine(smollm_gguf, dtype="bfloat16", ssm=["default", "ngram"], max_batch_size=4,
                  adaptive_tree=False)  # fmt: skip
    outs = spec.generate(prompts, params)
    same = sum(o.token_ids == r.token_ids for o, r in zip(outs, reference))
    steps = sum(o.metrics["steps"] for o in outs)
    tokens_per_step = sum(len(o.token_ids) - 1 for o in outs) / steps
    print(f"\n{n} prompts x {tokens}: {same} identical; {tokens_per_step:.2f} tokens/step")
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert tokens_per_step > 1.1, "too little was accepted for this to test verification"


def test_smollm_repetition_penalty_matches_transformers(smollm_gguf, tmp_path):
    """Incremental decoding with a repetition penalty equals HF transformers' generate with the
    same penalty (float32, the same GGUF loaded by transformers)."""
    transformers = pytest.importorskip("transformers")
    from test_generation_vs_hf import WRITTEN

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    )
    engine = Engine(smollm_gguf, dtype="float32")
    params = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    for prompt in WRITTEN[:2]:
        ids = engine.tokenizer.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert engine.generate(ids, params)[0].token_ids == ref[0, len(ids) :].tolist()
