"""Tree-based speculative decoding end to end: lossless for greedy (token-identical to
incremental) and for sampling (chi-squared against the exact incremental distribution)."""

import json
import math
import shutil
from itertools import combinations, count, product

import pytest
import torch

import specinfer.engine.sequence
from marks import CUDA
from specinfer import Engine, SamplingParams, drafting, ops
from specinfer.budget import PATIENCE, TreeBudget
from specinfer.speculator import Speculator
from specinfer.tree import TreeConfig, merge_trees
from test_budget import SteepCosts

VOCAB = 6
PROMPT = [1, 4, 2]


def _tiny_llama(path, seed: int, layers: int = 2, vocab: int = VOCAB, heads: int = 4,
                kv_heads: int = 2, hidden: int = 32, tied: bool = False):  # fmt: skip
    """A random small-vocabulary Llama saved as an HF directory, with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=128, initializer_range=0.4, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return _tiny_llama(root / "target", seed=0, layers=3), _tiny_llama(root / "ssm", seed=1)


HEAD_TOKENS = [5, 2, 0, 3]  # a restricted LM head: ids in any order, two tokens left out


@pytest.fixture(scope="module")
def restricted_ssm(tiny_pair, tmp_path_factory):
    """The tiny SSM with a head_tokens.json, as the training pipeline exports it."""
    path = tmp_path_factory.mktemp("restricted") / "ssm"
    shutil.copytree(tiny_pair[1], path)
    (path / "head_tokens.json").write_text(json.dumps({"tokens": HEAD_TOKENS}))
    return path


# -- greedy: token-identical --------------------------------------------------------------------


BEAM = TreeConfig((3, 3, 2, 2), beam=2)  # only a level's two likeliest nodes get children


@pytest.mark.parametrize("tree", ["1,1,3,1", "2,2,2", "3,1,1,1,1", BEAM], ids=str)
@pytest.mark.parametrize("ssm_kind", ["other", "self", "layers"])
def test_greedy_tree_equals_incremental_tiny(tiny_pair, tree, ssm_kind):
    target, other = tiny_pair
    ssm = {"other": other, "self": target, "layers": 1}[ssm_kind]  # "self" accepts whole paths
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    for mode in ("tree", "sequence"):
        # The self SSM verifies whole trees: drafting with the target never pays, so the
        # cut would stop it and leave nothing deep to check.
        engine = Engine(target, dtype="float32", ssm=ssm, tree=tree, mode=mode, max_batch_size=3,
                        adaptive_tree=ssm_kind != "self")  # fmt: skip
        outs = engine.generate(prompts, params)  # 4 prompts on 3 rows: a row gets reused
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (mode, tree)
        single = engine.generate(prompts[2], params)[0]
        assert single.token_ids == reference[2].token_ids
        if ssm_kind == "self":  # a perfect SSM: every step accepts a whole root-to-leaf path
            assert outs[0].metrics["tokens_per_step"] > 2.0


def test_packed_projections_keep_speculation_exact(tiny_pair, monkeypatch):
    """Where the CPU's fastest linear takes packed weights (AVX2 machines; forced here), the
    engine packs every projection of the target and of its SSMs before the first forward, and
    speculation stays token-identical to incremental decoding."""
    monkeypatch.setattr(ops, "panels_preferred", lambda dtype: True)
    target, other = tiny_pair
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="bfloat16")
    assert reference.model.model.layers[0].mlp.down_proj.weight.dim() == 3
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    engine = Engine(target, dtype="bfloat16", ssm=[other, 1, "ngram"], tree="2,2,1",
                    ssm_int8=False, adaptive_tree=False)  # fmt: skip
    for ssm in engine.drafter.ssms[:2]:  # its own layers; the target's first one
        assert ssm.model.model.layers[0].self_attn.qkv_proj.weight.dim() == 3
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected


def test_a_packed_lm_head_is_also_the_tied_embedding(tmp_path, monkeypatch):
    """A vocabulary of 32: the LM head packs too, and the embedding tied to it reads the packed
    table; so does a layer-selected SSM's restricted head (its first 16 tokens), which it then
    drafts through as panels of its own."""
    monkeypatch.setattr(ops, "panels_preferred", lambda dtype: True)
    target = _tiny_llama(tmp_path / "tied", seed=2, layers=3, vocab=32, tied=True)
    prompts = [PROMPT, [3, 9, 15], [5, 5, 1, 0, 2, 4, 4]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="bfloat16")
    model = reference.model
    assert (
        model.lm_head.weight.dim() == 3 and model.lm_head.weight is model.model.embed_tokens.weight
    )
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    engine = Engine(target, dtype="bfloat16", ssm=[1, "ngram"], tree="2,2,1", ssm_head=16,
                    adaptive_tree=False)  # fmt: skip
    ssm = engine.drafter.ssms[0]
    assert ssm.head_weight.shape == (16, 32) and ssm.head_packed.shape == (1, 32, 16)
    weights, linear = [], ops.linear
    monkeypatch.setattr(ops, "linear", lambda x, w, *a: weights.append(w) or linear(x, w, *a))
    hidden = torch.randn(3, 32).bfloat16()
    logits = ssm._logits(hidden)
    assert weights == [ssm.head_packed]
    reference_logits = hidden.double() @ ssm.head_weight.double().T
    torch.testing.assert_close(logits.double(), reference_logits, rtol=1e-2, atol=1e-2)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected


def test_a_long_prompt_admitted_beside_a_long_request(tiny_pair):
    """Continuous batching: a long prompt joins while another request is near the end of its
    cache row; the SSM catches up on it without padding the other request past its row."""
    target, other = tiny_pair
    prompts = [[1, 4, 2], [3, 3, 1], [2, 5] * 15]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 50, 5)]
    reference = Engine(target, dtype="float32").generate(prompts, params)
    spec = Engine(target, dtype="float32", ssm=other, tree="1,1", max_batch_size=2)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [r.token_ids for r in reference]


@pytest.mark.parametrize(
    "ssm, tree",
    [
        (["other", "layers", "ngram"], "2,1,2"),
        (["other", "ngram:max_n=2,depth=4,branches=2"], ["1,3,1", None]),
        (["self", "layers"], ["1,1,1", "3,2"]),
        (["ngram"], None),
        (["restricted", "ngram:depth=3"], "2,2"),
        (["layers:head"], "2,2"),
    ],
    ids=[
        "other+layers+ngram",
        "other+ngram-branches",
        "self+layers",
        "ngram",
        "restricted+ngram",
        "layers-first-ids-head",
    ],  # fmt: skip
)
def test_greedy_merged_trees_equal_incremental_tiny(tiny_pair, restricted_ssm, ssm, tree):
    target, other = tiny_pair
    named = {"other": other, "self": target, "layers": 1, "restricted": restricted_ssm,
             "layers:head": 2}  # fmt: skip
    specs = [named.get(s, s) for s in ssm]
    head = 3 if ssm == ["layers:head"] else None  # the first 3 token ids
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4, 5, 5, 1], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    for mode in ("tree", "sequence"):
        engine = Engine(target, dtype="float32", ssm=specs, tree=tree, mode=mode,
                        max_batch_size=3, ssm_head=head, adaptive_tree=ssm[0] != "self")  # fmt: skip
        outs = engine.generate(prompts, params)  # 4 prompts on 3 rows: a row gets reused
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (mode, ssm, tree)
        per_ssm = outs[2].metrics["per_ssm"]
        assert [s["name"] for s in per_ssm] == [d.name for d in engine.drafter.ssms]
        assert all(s["ssm_s"] > 0 for s in per_ssm)
        # every accepted node was proposed by some SSM; a node may count for several
        accepted = sum(outs[2].metrics["accepted_per_depth"])
        assert (
            max(s["accepted"] for s in per_ssm) <= accepted <= sum(s["accepted"] for s in per_ssm)
        )
        if ssm[0] == "self":  # its K/V must follow the accepted paths through the merged tree
            assert outs[0].metrics["tokens_per_step"] > 3.0
    if head:
        assert engine.drafter.ssms[0].head_ids.tolist() == [0, 1, 2]


def test_a_stopped_ssm_owes_the_prompts_it_skipped(tiny_pair):
    """New prompts are not fed to an SSM the budget has stopped: its backlog (tokens it would
    feed before drafting, which a retry must earn back) is then the whole prompt; an SSM that
    drafts was fed at prefill and owes nothing. Prompt lookup never owes anything."""
    assert _first_backlog(*tiny_pair, stopped=False) == [0, 0]
    assert _first_backlog(*tiny_pair, stopped=True) == [len(PROMPT), 0]


def _first_backlog(target, ssm, stopped: bool) -> list[int]:
    """What the budget is told each drafter owes at the first decode step of PROMPT."""
    engine = Engine(target, dtype="float32", ssm=[ssm, "ngram"])
    backlogs, drafts = [], engine.budget.drafts

    def spy(n, batch, backlog):
        backlogs.append(backlog)
        return drafts(n, batch, backlog)

    engine.budget.drafts = spy
    if stopped:
        engine.budget._idle[0] = PATIENCE
    engine.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))
    return backlogs[0]


@pytest.mark.skipif(ops._C is None, reason="needs the compiled extension (op graphs)")
def test_the_budget_is_told_how_each_forward_ran(tiny_pair):
    """Each step hands the budget the runner's word on its forward (graphs.GraphRunner.warm):
    a recording is not a price, a replay is."""
    engine = Engine(tiny_pair[0], dtype="bfloat16", ssm="ngram", tree="2")
    told, time_step = [], engine.budget.time_step

    def spy(*args):
        told.append((args[-1], engine.runner.graphs.warm))
        return time_step(*args)

    engine.budget.time_step = spy
    engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert told and all(a == b for a, b in told)
    assert {False, True} <= {a for a, _ in told}


def test_restricted_head_proposes_only_its_tokens(tiny_pair, restricted_ssm):
    engine = Engine(tiny_pair[0], dtype="float32", ssm=restricted_ssm, tree="3,3")
    (ssm,) = engine.drafter.ssms
    assert ssm.head_ids.tolist() == HEAD_TOKENS
    trees, draft = [], ssm.draft

    def recording_draft(*args):
        trees.extend(draft(*args))
        return trees[-1:]

    ssm.draft = recording_draft
    engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert trees and all(set(t.tokens[1:]) <= set(HEAD_TOKENS) for t in trees)
    assert any(len(t) == 13 for t in trees)  # full 3 x 3 trees: 3 of the 4 head tokens each
    with pytest.raises(ValueError, match="ssm_head must be an integer >= 0"):
        Engine(tiny_pair[0], ssm=1, ssm_head=-1)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "expected"),
        ('{"tokens": []}', "non-empty list"),
        ('{"tokens": [1, 6]}', r"out of range \[0, 6\): \[6\]"),
        ('{"tokens": [1, 1]}', "repeat"),
    ],
)
def test_bad_head_tokens_file(tmp_path, content, message):
    (tmp_path / "head_tokens.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        drafting.head_token_ids(tmp_path, None, VOCAB)


def test_head_token_ids_choice(tmp_path):
    assert drafting.head_token_ids("layers:2", None, VOCAB) is None  # full head by default
    assert drafting.head_token_ids("layers:2", 4, VOCAB) == [0, 1, 2, 3]
    assert drafting.head_token_ids("layers:2", 6, VOCAB) is None
    (tmp_path / "head_tokens.json").write_text(json.dumps({"tokens": HEAD_TOKENS}))
    assert drafting.head_token_ids(tmp_path, None, VOCAB) == HEAD_TOKENS
    assert drafting.head_token_ids(tmp_path, 2, VOCAB) == HEAD_TOKENS[:2]
    assert drafting.head_token_ids(tmp_path, 0, VOCAB) is None


def test_a_beam_tree_keeps_in_the_ssm_cache_only_nodes_the_ssm_ran(tiny_pair):
    """With a beam, an accepted node the SSM gave no children has no K/V in the SSM's cache:
    after each request, the SSM's cache over its tokens is what a fresh prefill of them makes
    (a stale slot kept as an accepted node's would differ from it)."""
    from types import SimpleNamespace

    target, other = tiny_pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with Engine(target, dtype="float32", ssm=other, tree=BEAM, adaptive_tree=False) as engine:
        ssm = engine.drafter.ssms[0]
        for prompt in [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]:
            out = engine.generate(prompt, params)[0]
            (row,) = [r for r, n in enumerate(ssm.cached) if n > 0]
            n = ssm.cached[row]
            assert n > len(prompt) + 8  # accepted paths were kept
            fresh = Speculator(ssm.model, BEAM)
            fresh.reset(1, 128)
            fresh.prefill([SimpleNamespace(row=0)], [(prompt + out.token_ids)[:n]])
            for mine, theirs in zip(ssm.kv.k + ssm.kv.v, fresh.kv.k + fresh.kv.v):
                torch.testing.assert_close(mine[row, :, :n], theirs[0, :, :n], atol=1e-4,
                                           rtol=1e-4)  # fmt: skip
            ssm.cached[row] = 0  # the next prompt may take another row


def test_ssm_runs_no_forward_for_its_last_level(tiny_pair):
    """A draft of depth d costs d SSM forwards (the fed tokens, then levels 1..d-1): the last
    level's nodes are leaves, whose predictions nobody reads; depth 0 (the request's last
    token, or the budget stopped this SSM) costs none. The prompt is fed once, when the
    target has prefilled it, outside any draft."""
    target, other = tiny_pair
    engine = Engine(target, dtype="float32", ssm=other, tree="1,2,1")
    ssm = engine.drafter.ssms[0]
    forwards, caps = [0], []  # forwards[0]: the prompt's, before the first draft
    run_model, draft = ssm.run_model, ssm.draft

    def counted_run(*args):
        forwards[-1] += 1
        return run_model(*args)

    def counted_draft(batch, tokens, max_depths):
        forwards.append(0)
        caps.append(max_depths[0])
        return draft(batch, tokens, max_depths)

    ssm.run_model, ssm.draft = counted_run, counted_draft
    engine.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(forwards) >= 4
    assert forwards == [1] + [min(3, cap) for cap in caps]


def test_speculative_metrics_and_bad_configs(tiny_pair):
    target, other = tiny_pair
    engine = Engine(target, dtype="float32", ssm=target, tree="1,2,1")
    out = engine.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    m = out.metrics
    assert m["steps"] >= 1 and m["ssm_s"] > 0 and m["target_s"] > 0
    with pytest.raises(ValueError, match="needs an ssm"):
        Engine(target, mode="tree")
    with pytest.raises(ValueError, match="more than max_nodes"):
        Engine(target, ssm=1, tree="8,8,8")
    with pytest.raises(ValueError, match="1 <= layers < 3"):
        Engine(target, ssm=3)
    with pytest.raises(FileNotFoundError, match="SSM not found"):
        Engine(target, ssm=target / "nope")
    with pytest.raises(ValueError, match="2 tree configs for 3 SSMs"):
        Engine(target, ssm=[1, 2, "ngram"], tree=["1,1", "2"])
    with pytest.raises(ValueError, match="not a tree config"):
        Engine(target, ssm=[1, "ngram"], tree=["1,1", "2"])
    with pytest.raises(ValueError, match="bad ngram option"):
        Engine(target, ssm="ngram:width=3")


def _accepted_depth(tree, continuation: list[int]) -> int:
    """How many tokens of `continuation` (what follows the tree's root in the output) the tree
    holds as one path from its root: what greedy verification must accept."""
    node, depth = 0, 0
    while depth < len(continuation):
        children = [c for c in range(len(tree)) if tree.parents[c] == node]
        node = next((c for c in children if tree.tokens[c] == continuation[depth]), None)
        if node is None:
            break
        depth += 1
    return depth


@pytest.mark.parametrize("ssm_kind", ["other", "self", "wrong"])
def test_speculative_metrics_count_forwards_and_accepted_nodes(tiny_pair, tmp_path, ssm_kind):
    """steps and tokens_per_step against the target forwards (counted at its LM head), and
    accepted_per_depth against the depth to which each drafted tree follows the incremental
    output; a perfect SSM (the target) accepts every depth of every step, a wrong one (a head of
    tokens the output never holds) none."""
    target, other = tiny_pair
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(PROMPT, params)[0].token_ids
    ssm = {"other": other, "self": target, "wrong": tmp_path / "wrong"}[ssm_kind]
    if ssm_kind == "wrong":
        shutil.copytree(other, ssm)
        unused = sorted(set(range(VOCAB)) - set(reference))
        assert len(unused) >= 2, reference
        (ssm / "head_tokens.json").write_text(json.dumps({"tokens": unused}))
    engine = Engine(target, dtype="float32", ssm=ssm, tree="1,2,1", adaptive_tree=False)
    forwards, drafts = [0], []  # target forwards; (output tokens so far, tree) per draft
    compute_logits, draft = engine.model.compute_logits, engine.drafter.draft

    def counted_logits(hidden):  # once per target forward (the SSM is another model)
        forwards[0] += 1
        return compute_logits(hidden)

    def recorded_draft(batch, tokens, max_depths):
        trees = draft(batch, tokens, max_depths)
        drafts.append((len(tokens[0]) - len(PROMPT), trees[0]))
        return trees

    engine.model.compute_logits, engine.drafter.draft = counted_logits, recorded_draft
    out = engine.generate(PROMPT, params)[0]
    assert out.token_ids == reference
    m = out.metrics
    steps = forwards[0] - 1  # one prefill forward, then one per step
    assert m["steps"] == steps == len(drafts)
    assert m["tokens_per_step"] == pytest.approx((len(reference) - 1) / steps)
    assert all(tree.tokens[0] == reference[n - 1] for n, tree in drafts)  # rooted at the newest
    depths = [_accepted_depth(tree, reference[n:]) for n, tree in drafts]
    assert sum(d + 1 for d in depths) == len(reference) - 1  # each step: accepted + 1 token
    assert m["accepted_per_depth"] == [sum(d > k for d in depths) for k in range(max(depths))]
    if ssm_kind == "self":  # 12 tokens after the prefill's: 3 steps of 3 accepted + 1
        assert m["accepted_per_depth"] == [3, 3, 3] and steps == 3
    elif ssm_kind == "wrong":
        assert m["accepted_per_depth"] == [] and steps == len(reference) - 1
    else:
        assert 0 < sum(depths) < 3 * steps  # partly accepted: the counts are not trivial


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("ssm", [["other", "ngram"], ["other", 1]])
def test_greedy_with_cut_trees_equals_incremental(tiny_pair, ssm, device):
    """Merged trees, whole and cut, equal incremental decoding on the same device (on a GPU:
    the CUDA tree attention, KV commit and top-k expansion)."""
    target, other = tiny_pair
    specs = [other if s == "other" else s for s in ssm]
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4, 5, 5, 1], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="float32", device=device).generate(prompts, params)
    nodes = {}
    for cut in (False, True):
        engine = Engine(target, dtype="float32", device=device, ssm=specs, tree="2,2,1",
                        max_batch_size=3, adaptive_tree=cut)  # fmt: skip
        if cut:
            engine.budget = SteepCosts()  # cuts whatever the machine's timings
        outs = engine.generate(prompts, params)  # 4 prompts on 3 rows: a row gets reused
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], cut
        nodes[cut] = sum(o.metrics["tree_nodes"] / o.metrics["steps"] for o in outs)
    assert nodes[True] < nodes[False] and engine.budget.cut > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_max_tree_nodes_caps_every_verified_tree_and_stays_exact(tiny_pair, adaptive):
    target, other = tiny_pair
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    engine = Engine(target, dtype="float32", ssm=[target, "ngram"], tree="2,2,1",
                    max_tree_nodes=3, adaptive_tree=adaptive, max_batch_size=3)  # fmt: skip
    if adaptive:  # fixed prices: what it accepts must not depend on this machine's timings
        engine.budget = SteepCosts(steepness=0.005)
    widths, forward = [], engine.runner.tree

    def tree_forward(kv, seqs, trees):
        widths.extend(len(t) for t in trees)
        return forward(kv, seqs, trees)

    engine.runner.tree = tree_forward
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert max(widths) == 3  # drafted trees have up to 1 + 10 + 5 nodes
    assert sum(o.metrics["accepted_per_depth"][0] for o in outs) > 0
    with pytest.raises(ValueError, match="max_tree_nodes must be an integer >= 1"):
        Engine(target, dtype="float32", ssm=other, max_tree_nodes=0)
    with pytest.raises(ValueError, match="sampled children"):
        Engine(target, dtype="float32", ssm=other, max_tree_nodes=3,
               tree=TreeConfig((2, 2), sample_children=True))  # fmt: skip


class Rotating(TreeBudget):
    """Drafts with every set of drafters in turn (all, ..., none) and keeps whole trees: each
    SSM skips steps, and the prompts of requests that join meanwhile, and catches up."""

    calls = 0
    last: frozenset = frozenset()
    drafters = 0

    def drafts(self, drafters, batch=1, backlog=None):
        sets = [
            frozenset(c) for k in range(drafters, -1, -1) for c in combinations(range(drafters), k)
        ]
        self.calls += 1
        self.drafters, self.last = drafters, sets[self.calls % len(sets)]
        return self.last

    def stopped(self):  # those skipped last step: they do not feed prompts cached meanwhile
        return set(range(self.drafters)) - self.last

    def choose(self, trees, params, draft_s=None):
        return [list(range(len(t))) for t in trees]


class NeverDrafts(TreeBudget):
    def drafts(self, drafters, batch=1, backlog=None):
        return frozenset()


@pytest.mark.parametrize("ssm", ["self", "other+ngram", "layers"])
def test_skipped_drafts_catch_up_and_stay_exact(tiny_pair, ssm):
    target, other = tiny_pair
    specs = {"self": target, "other+ngram": [other, "ngram"], "layers": 1}[ssm]
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    engine = Engine(target, dtype="float32", ssm=specs, tree="1,1,1", max_batch_size=3)
    engine.budget = Rotating()
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for o in outs:
        m = o.metrics
        assert 0 < m["tree_nodes"] - m["steps"] < 3 * m["steps"]  # some steps drafted, not all
        if ssm == "self":  # caught up after each skip, its drafts are still the target's own
            acc = m["accepted_per_depth"]  # the last steps of a request may cap the depth
            assert len(acc) == 3 and acc[2] >= acc[0] - 2 and acc[0] >= m["steps"] // 2 - 1, m


def test_seeded_sampling_is_drafted_when_the_others_are_not(tiny_pair):
    target, other = tiny_pair
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True)]  # fmt: skip
    whole = Engine(target, dtype="float32", ssm=other, tree="2,1", adaptive_tree=False)
    expected = whole.generate([PROMPT, [3]], params)
    engine = Engine(target, dtype="float32", ssm=other, tree="2,1")
    engine.budget = NeverDrafts()
    seeded, greedy = engine.generate([PROMPT, [3]], params)
    assert seeded.token_ids == expected[0].token_ids  # its seed reproduces it, whatever the load
    assert seeded.metrics["tree_nodes"] > seeded.metrics["steps"]  # it was drafted
    assert greedy.token_ids == expected[1].token_ids
    assert greedy.metrics["tree_nodes"] == greedy.metrics["steps"]  # plain decoding


# -- sampling: the same distribution as incremental sampling ------------------------------------

SAMPLES = 20_000
PARAMS = {"temperature": 1.0}


def _filtered(dist: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """dist cut to its top_k tokens, then to the most likely of those until they hold top_p of
    their mass, then to those at least min_p times as likely as the first, renormalised; written
    token by token, independently of sampling.probabilities."""
    ranked = sorted(range(len(dist)), key=lambda t: -dist[t].item())[: top_k or None]
    total, mass, kept = sum(dist[t].item() for t in ranked), 0.0, torch.zeros_like(dist)
    for t in ranked:
        if mass >= top_p * total or dist[t].item() < min_p * dist[ranked[0]].item():
            break
        kept[t], mass = dist[t], mass + dist[t].item()
    return kept / kept.sum()


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's logits after `ids`, from one plain causal forward."""
    T = len(ids)
    kv = model.make_kv_cache(1, T)
    hidden = model(torch.tensor([ids]), torch.arange(T)[None], kv, torch.tensor([0]),
                   torch.tensor([0]), torch.ones(1, T, T, dtype=torch.bool).tril())  # fmt: skip
    return model.compute_logits(hidden[0, -1])


def _exact_joint(engine: Engine, n: int = 3, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0,
                 prompt: list[int] = PROMPT) -> dict[tuple, float]:  # fmt: skip
    """P(first n tokens) under incremental sampling, from the target's own logits."""
    model = engine.model
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in probs.items():
            logits = _last_logits(model, prompt + list(prefix)).double()
            dist = _filtered(torch.softmax(logits / temperature, -1), top_k, top_p, min_p)
            for t in range(VOCAB):
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


def _chi_squared_p(
    counts: dict[tuple, int], expected: dict[tuple, float], total: int
) -> tuple[float, float]:
    """Pearson chi-squared with cells of expected count < 5 pooled; p from Wilson-Hilferty."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e, o = p * total, counts.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    df = cells - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return stat, 0.5 * math.erfc(z / math.sqrt(2))


def _sample_first3(engine: Engine, n: int = SAMPLES, seeded: bool = True, sampling: dict = PARAMS,
                   prompt: list[int] = PROMPT) -> dict[tuple, int]:  # fmt: skip
    params = [SamplingParams(max_tokens=3, seed=s if seeded else None, ignore_eos=True, **sampling)
              for s in range(n)]  # fmt: skip
    outs = engine.generate([prompt] * n, params)
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def exact(tiny_pair):
    return _exact_joint(Engine(tiny_pair[0], dtype="float32"), **PARAMS)


def _speculative_engine(tiny_pair, **kwargs):
    kwargs = {"ssm": tiny_pair[1], **kwargs}
    return Engine(tiny_pair[0], dtype="float32", max_batch_size=512, **kwargs)


SAMPLED, TOP_K = TreeConfig((3, 2), sample_children=True), TreeConfig((2, 2))


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("incremental", {}),
        ("mss, sampled children", {"tree": TreeConfig((3, 2), sample_children=True)}),
        ("mss, top-k children", {"tree": TreeConfig((2, 2))}),
        ("naive sampling", {"tree": TreeConfig((2, 2)), "verifier": "naive"}),
        # two SSMs with different distributions (one sampled, one top-k) and prompt lookup
        (
            "merged",
            {
                "ssm": ["other", 1, "ngram:max_n=2,depth=3,branches=2"],
                "tree": [SAMPLED, TOP_K, None],
            },
        ),  # fmt: skip
        ("restricted head, sampled", {"ssm": "restricted", "tree": SAMPLED}),
    ],
)
def test_sampling_matches_incremental_distribution(tiny_pair, restricted_ssm, exact, name, kwargs):
    named = {"other": tiny_pair[1], "restricted": restricted_ssm}
    if "ssm" in kwargs:
        ssm = kwargs["ssm"]
        ssm = [named.get(s, s) for s in ssm] if isinstance(ssm, list) else named[ssm]
        kwargs = {**kwargs, "ssm": ssm}
    engine = (
        Engine(tiny_pair[0], dtype="float32", max_batch_size=512)
        if not kwargs
        else _speculative_engine(tiny_pair, **kwargs)
    )
    stat, p = _chi_squared_p(_sample_first3(engine), exact, SAMPLES)
    print(f"\n{name}: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"{name}: chi2 = {stat:.1f}, p = {p:.2e}"


FILTERS = {
    "temperature 0.7": {"temperature": 0.7},
    "top_k 3": {"temperature": 1.0, "top_k": 3},
    "top_p 0.8": {"temperature": 1.0, "top_p": 0.8},
    "min_p 0.3": {"temperature": 1.0, "min_p": 0.3},
}


@pytest.fixture(scope="module")
def exact_filtered(tiny_pair):
    engine = Engine(tiny_pair[0], dtype="float32")
    return {name: _exact_joint(engine, **sampling) for name, sampling in FILTERS.items()}


FILTERED_SAMPLES = 10_000
CHILDREN = [("mss, sampled children", SAMPLED), ("mss, top-k children", TOP_K)]


FILTERED_CASES = [("incremental", None, f) for f in FILTERS] + [
    (name, tree, f) for name, tree in CHILDREN for f in FILTERS
]


@pytest.mark.parametrize(
    "name, tree, filters", FILTERED_CASES, ids=[f"{n}, {f}" for n, _, f in FILTERED_CASES]
)
def test_filtered_sampling_matches_incremental_distribution(
    tiny_pair, exact_filtered, name, tree, filters
):
    """Temperature, top-k, top-p and min-p under speculation: the target's filtered distribution
    (what incremental sampling draws from, computed here on its own), where the filters leave
    tokens of probability 0 that must never appear, proposed by the SSM or not."""
    engine = (
        Engine(tiny_pair[0], dtype="float32", max_batch_size=512)
        if tree is None
        else _speculative_engine(tiny_pair, tree=tree)
    )
    exact, n = exact_filtered[filters], FILTERED_SAMPLES
    counts = _sample_first3(engine, n, sampling=FILTERS[filters])
    impossible = {key: c for key, c in counts.items() if exact[key] == 0}
    assert not impossible, f"{name}, {filters}: outputs of probability 0: {impossible}"
    stat, p = _chi_squared_p(counts, exact, n)
    print(f"\n{name}, {filters}: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"{name}, {filters}: chi2 = {stat:.1f}, p = {p:.2e}"


def test_filtered_exact_joints_differ(exact, exact_filtered):
    """The filters matter on this model: top-k, top-p and min-p leave out most sequences, and a
    lower temperature moves the distribution (so a test that ignored them would fail)."""
    for name, joint in exact_filtered.items():
        assert sum(joint.values()) == pytest.approx(1.0)
        assert max(abs(joint[k] - exact[k]) for k in exact) > 0.02, name
    assert sum(p == 0 for p in exact_filtered["top_k 3"].values()) == VOCAB**3 - 3**3
    assert sum(p == 0 for p in exact_filtered["top_p 0.8"].values()) > VOCAB**3 / 2
    assert sum(p == 0 for p in exact_filtered["min_p 0.3"].values()) > VOCAB**3 / 2


def _wrong_ratio_on_topk(self, tree, nodes, logits, width, params, generator, paths):
    """Top-k children verified as if they were drawn from the SSM's distribution: biased."""
    from specinfer.sampling import probabilities

    for node, q in zip(nodes, probabilities(logits, params.temperature)):
        row = tree.add_distribution(q)
        for t in torch.topk(q, width).indices.tolist():
            tree.propose(node, t, row)


def _forget_multiplicity(self, tree, nodes, logits, width, params, generator, paths):
    """Sampled children with duplicate draws collapsed to one proposal: biased."""
    from specinfer.sampling import probabilities

    for node, q in zip(nodes, probabilities(logits, params.temperature)):
        row = tree.add_distribution(q)
        draws = torch.multinomial(q, width, replacement=True, generator=generator).tolist()
        for t in dict.fromkeys(draws):
            tree.propose(node, t, row)


@pytest.mark.parametrize(
    "name, expand",
    [("q ratio on top-k", _wrong_ratio_on_topk), ("no multiplicity", _forget_multiplicity)],
)
def test_the_test_detects_biased_verification(tiny_pair, exact, monkeypatch, name, expand):
    monkeypatch.setattr(Speculator, "_expand", expand)
    engine = _speculative_engine(tiny_pair, tree=TreeConfig((3, 3), sample_children=True))
    # The bias is large: 5,000 samples already reject it overwhelmingly (and keep CI short).
    stat, p = _chi_squared_p(_sample_first3(engine, 5_000), exact, 5_000)
    print(f"\n{name}: chi2 = {stat:.1f}, p = {p:.2e}")
    assert p < 1e-3, f"{name} should be detected as biased: chi2 = {stat:.1f}, p = {p:.3f}"


def _merge_with_swapped_distributions(trees):
    """A merge that tests each sampled child against the *other* SSM's distribution at the same
    parent (where that SSM drew children there too): biased."""
    merged, maps = merge_trees(trees)
    rows: dict[tuple[int, int], int] = {}  # (parent, source) -> q row
    for parent, q, source in zip(merged.prop_parent, merged.prop_q, merged.prop_source):
        if q >= 0:
            rows[parent, source] = q
    merged.prop_q = [
        rows.get((parent, 1 - source), q) if q >= 0 else q
        for parent, q, source in zip(merged.prop_parent, merged.prop_q, merged.prop_source)
    ]
    return merged, maps


def test_the_test_detects_the_wrong_ssm_distribution(tiny_pair, exact, monkeypatch):
    monkeypatch.setattr(drafting, "merge_trees", _merge_with_swapped_distributions)
    engine = _speculative_engine(
        tiny_pair, ssm=[tiny_pair[1], 1], tree=TreeConfig((3, 3), sample_children=True)
    )
    stat, p = _chi_squared_p(_sample_first3(engine, 5_000), exact, 5_000)
    print(f"\nwrong SSM's distribution: chi2 = {stat:.1f}, p = {p:.2e}")
    assert p < 1e-3, (
        f"the wrong SSM's distribution should be detected: chi2 = {stat:.1f}, p = {p:.3f}"
    )


def test_exact_joint_is_a_distribution(exact):
    assert len(exact) == VOCAB**3
    assert sum(exact.values()) == pytest.approx(1.0)
    assert set(exact) == set(product(range(VOCAB), repeat=3))


@pytest.fixture
def counted_seeds(monkeypatch):
    """Unseeded requests' generators seeded from a counter, so a statistical test over them is
    reproducible (unseeded, a fair sampler fails a p > 0.01 test in 1% of runs)."""
    seeds = count()
    monkeypatch.setattr(specinfer.engine.sequence, "make_generator",
                        lambda seed, device: torch.Generator(device).manual_seed(next(seeds)))  # fmt: skip


def test_sampling_with_cut_trees_matches_incremental_distribution(tiny_pair, exact, counted_seeds):
    """Unseeded requests (seeded ones keep whole trees, to reproduce), seeded from a counter."""
    engine = _speculative_engine(tiny_pair, tree=TreeConfig((2, 2)))
    engine.budget = SteepCosts()
    stat, p = _chi_squared_p(_sample_first3(engine, seeded=False), exact, SAMPLES)
    print(f"\ncut trees, top-k children: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"
    assert engine.budget.cut > 0, "no tree was cut"
