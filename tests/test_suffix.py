"""The suffix drafter: continuations of the context's longest suffix in earlier requests."""

import gc
import gzip
import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from specinfer import Engine, SamplingParams
from specinfer.default_model import DEFAULT_CORPUS
from specinfer.suffix import History, SuffixConfig, SuffixDrafter, read_corpus
from test_speculative import (  # noqa: F401 (tiny_pair, counted_seeds are fixtures)
    PARAMS,
    PROMPT,
    SAMPLES,
    _chi_squared_p,
    _exact_joint,
    counted_seeds,
    tiny_pair,
)

GREEDY = SamplingParams()


def _request(row: int = 0, params: SamplingParams = GREEDY):
    return SimpleNamespace(row=row, params=params)


def _paths(drafter: SuffixDrafter, seq: list[int], row: int = 0, params=GREEDY, depth: int = 99):
    tree = drafter.draft([_request(row, params)], [seq], [depth])[0]
    leaves = set(range(len(tree))) - set(tree.parents)
    paths = set()
    for leaf in leaves - {0}:
        path, node = [], leaf
        while node:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        paths.add(tuple(reversed(path)))
    return paths


def test_the_longest_suffix_grows_a_tree_of_what_followed_it_best_first():
    history = History(max_n=3, capacity=1000)
    history.add([1, 2, 3, 4, 5])
    history.add([9, 2, 3, 4, 6])
    history.add([7, 3, 4, 6, 8])
    # Nodes as (parent's index, -1: the root; token; share of the occurrences the parent's path
    # kept, over one more). (2, 3) occurs twice, (0, 2, 3) never: 4 followed both, then 5 and 6
    # one each (a tie: the first seen first); a sequence's end is no continuation.
    assert history.tree([0, 2, 3], depth=4, nodes=16) == [(-1, 4, 2 / 3), (0, 5, 1 / 3),
                                                          (0, 6, 1 / 3)]  # fmt: skip
    assert history.tree([0, 2, 3], depth=4, nodes=2) == [(-1, 4, 2 / 3), (0, 5, 1 / 3)]
    assert history.tree([0, 2, 3], depth=1, nodes=16) == [(-1, 4, 2 / 3)]
    # (1, 2, 3) occurs once: the shorter (2, 3), seen twice, says more.
    assert history.tree([1, 2, 3], depth=4, nodes=16) == history.tree([0, 2, 3], depth=4, nodes=16)
    # (3, 4): three occurrences, 6 followed two (worth 2/4), 5 one (1/4); after 6 only 8, for one
    # of its two (worth 2/4 * 1/3 = 1/6): 5 is grown before it.
    assert history.tree([3, 4], depth=4, nodes=16) == [(-1, 6, 2 / 4), (-1, 5, 1 / 4),
                                                       (0, 8, 1 / 3)]  # fmt: skip
    assert history.tree([3, 4], depth=4, nodes=1) == [(-1, 6, 2 / 4)]
    assert history.tree([42], depth=4, nodes=16) == []  # never seen
    assert history.tree([5], depth=4, nodes=16) == []  # only a sequence's end followed it


def test_the_tree_branches_where_the_continuations_split_at_any_depth():
    history = History(max_n=2, capacity=1000)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5]):
        history.add(seq)
    assert history.tree([1, 2], depth=4, nodes=16) == [(-1, 3, 3 / 4), (0, 4, 2 / 4),
                                                       (0, 5, 1 / 4)]  # fmt: skip


def test_a_chain_follows_the_most_worthy_path_alone():
    history = History(max_n=2, capacity=1000)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6]):
        history.add(seq)
    assert history.tree([1, 2], depth=4, nodes=16, chain=True) == [(-1, 3, 3 / 5), (0, 5, 2 / 4)]
    assert history.tree([1, 2], depth=4, nodes=1, chain=True) == [(-1, 3, 3 / 5)]


def test_history_forgets_its_older_half_past_its_capacity():
    history = History(max_n=2, capacity=11)
    history.add([1, 2, 3])
    history.add([4, 5, 6])
    history.add([7, 8, 9])  # 12 tokens with the ends: the older half, [1, 2, 3], goes
    assert history.tree([1], depth=2, nodes=4) == []
    assert history.tree([4], depth=2, nodes=4) == [(-1, 5, 1 / 2), (0, 6, 1 / 2)]
    assert history.tree([7], depth=2, nodes=4) == [(-1, 8, 1 / 2), (0, 9, 1 / 2)]
    assert len(history.tokens) == 8


def test_history_index_adds_no_objects_for_the_garbage_collector():
    """Every full collection walks each tracked container: one per n-gram made a 318k-token
    corpus stall a step by 0.3 s. Only the history's own few objects may be tracked."""
    gc.collect()
    before = len(gc.get_objects())
    history = History(max_n=6, capacity=1 << 16)
    rng = random.Random(0)
    for _ in range(50):
        history.add([rng.randrange(1000) for _ in range(200)])
    gc.collect()
    assert len(history.latest) > 10_000  # many distinct n-grams...
    assert len(gc.get_objects()) - before < 100  # ...but no container each


def test_a_corpus_is_kept_while_the_served_history_forgets_its_older_half(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("[1, 2, 3]\n[4, 5]\n")
    history = SuffixDrafter(SuffixConfig(max_n=2, history=7, corpus=str(corpus)), 10).history
    history.add([6, 7, 8])
    history.add([6, 9])  # 7 served tokens with their ends: within the history
    assert history.tree([6], depth=1, nodes=4) == [(-1, 7, 1 / 3), (-1, 9, 1 / 3)]
    history.add([6, 1])  # past it: the older served half ([6, 7, 8]) goes, the corpus stays
    assert history.tree([6], depth=1, nodes=4) == [(-1, 9, 1 / 3), (-1, 1, 1 / 3)]
    assert history.tree([1, 2], depth=2, nodes=4) == [(-1, 3, 1 / 2)]
    assert history.tree([4], depth=2, nodes=4) == [(-1, 5, 1 / 2)]
    assert list(history.tokens) == [1, 2, 3, -1, 4, 5, -1, 6, 9, -1, 6, 1, -1]


@pytest.mark.parametrize(
    "max_n, alphabet",
    [(1, range(3)), (3, range(3)), (6, range(4)), (4, range(50)), (3, [5, 65535, 70000])],
)
def test_a_corpus_indexed_at_once_drafts_as_if_added_a_sequence_at_a_time(max_n, alphabet):
    """The corpus's index (sorted at once; by 16-bit keys where the ids fit) and the served one
    (grown per sequence) find the same occurrences: the latest MATCHES of the longest suffix seen
    twice, across both."""
    rng = random.Random(max_n * len(alphabet))
    corpus = [rng.choices(alphabet, k=rng.randrange(40)) for _ in range(60)]
    served = [rng.choices(alphabet, k=rng.randrange(40)) for _ in range(8)]
    one_by_one, indexed = History(max_n, 1 << 20), History(max_n, 1 << 20, corpus)
    for seq in corpus + served:
        one_by_one.add(seq)
    for seq in served:
        indexed.add(seq)
    assert indexed.tokens == one_by_one.tokens
    for _ in range(200):
        context = rng.choices(alphabet, k=rng.randint(1, 8))
        depth, nodes = rng.randint(1, 6), rng.randint(1, 20)
        expected = one_by_one.tree(context, depth, nodes)
        assert indexed.tree(context, depth, nodes) == expected, context


def test_drafter_learns_from_requests_that_left_their_rows():
    drafter = SuffixDrafter(SuffixConfig(max_n=2, depth=3), vocab_size=10)
    drafter.reset(2, 100)
    drafter.prefill([_request(0)], [[5, 6, 7, 8, 9]])
    assert _paths(drafter, [1, 6, 7], row=1) == set()  # row 0's request has not left yet
    drafter.admit(0)  # a new request takes row 0: the old one joins the history
    seq = [1, 6, 7]
    assert _paths(drafter, seq, row=1) == {(8, 9)}
    assert _paths(drafter, seq, row=1, depth=1) == {(8,)}
    seeded = SamplingParams(temperature=1.0, seed=3)  # its seed must not depend on history
    assert _paths(drafter, seq, row=1, params=seeded) == set()
    drafter.rollback(1, 2)  # forgets row 1's tokens past the first 2
    assert seq == [1, 6, 7]  # the caller's list is not the drafter's to cut
    drafter.reset(2, 100)  # a new batch: rows 0 and 1 join the history
    assert _paths(drafter, [3, 1], row=0) == {(6,)}  # from row 1's [1, 6]
    with drafter.unrecorded():  # e.g. a benchmark's warm-up
        drafter.prefill([_request(1)], [[2, 4, 4]])
        drafter.admit(1)
        assert _paths(drafter, [2], row=0) == {(4, 4)}
    assert _paths(drafter, [2], row=0) == set()  # forgotten, and row 0's [3, 1] with it
    drafter.admit(0)
    assert _paths(drafter, [3], row=1) == set()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("suffix:depth=0", "depth must be a positive integer"),
        ("suffix:width=2", "bad suffix option"),
        ("suffix:corpus=/nonexistent.jsonl", "suffix corpus not found"),
    ],
)
def test_bad_specs(tiny_pair, spec, message):  # noqa: F811
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        Engine(tiny_pair[0], ssm=spec)


def test_a_corpus_may_be_gzipped(tmp_path):
    corpus = tmp_path / "answers.jsonl.gz"
    corpus.write_bytes(gzip.compress(b"[1, 2, 3]\n\n[4, 5]\n"))
    assert read_corpus(corpus, vocab_size=6) == [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"answers.jsonl.gz:3: .*vocab"):
        read_corpus(corpus, vocab_size=5)
    corpus.write_bytes(b"[1, 2, 3]\n")  # named .gz, not gzipped
    with pytest.raises(ValueError, match=r"answers.jsonl.gz: not a corpus of JSON lines"):
        read_corpus(corpus, vocab_size=6)


def test_the_shipped_corpus_is_the_default_models_answers(tiny_pair):  # noqa: F811
    with pytest.raises(ValueError, match=r'"suffix:corpus=default" is the corpus of answers of'):
        Engine(tiny_pair[0], ssm="suffix:corpus=default")
    corpus = read_corpus(DEFAULT_CORPUS, vocab_size=49152)
    assert len(corpus) >= 1000 and all(len(seq) > 10 for seq in corpus)


@pytest.mark.parametrize(
    "line, message",
    [("[1, 2, x]", "not JSON"), ('{"a": 1}', "a JSON list"), ("[1, 2.5]", "a JSON list"),
     ("[true, 3]", "a JSON list"), ("[[1, 2]]", "a JSON list"), ('[1, "2"]', "a JSON list"),
     ("[1, 99]", "vocab"), ("[1, -2]", "vocab")],
)  # fmt: skip
def test_bad_corpus_lines(tiny_pair, tmp_path, line, message):  # noqa: F811
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(f"[1, 2]\n{line}\n")
    with pytest.raises(ValueError, match=rf"corpus.jsonl:2: .*{message}"):
        Engine(tiny_pair[0], ssm=f"suffix:corpus={corpus}")


def test_greedy_with_suffix_drafts_equals_incremental(tiny_pair):  # noqa: F811
    target, other = tiny_pair
    # Repeated prompts on 2 rows: later requests find the earlier ones' continuations.
    prompts = [PROMPT, [5, 5, 1, 0, 2], PROMPT, [2, 3], [5, 5, 1, 0, 2], PROMPT]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    for ssm, mode in ((["suffix"], None), (["suffix"], "sequence"),
                      ([other, "ngram", "suffix:max_n=3,depth=4,nodes=6"], None)):  # fmt: skip
        engine = Engine(target, dtype="float32", ssm=ssm, tree="2,1", max_batch_size=2,
                        adaptive_tree=False, mode=mode)  # fmt: skip
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (ssm, mode)
        suffix = [o.metrics["per_ssm"][-1] for o in outs]
        assert all(s["name"].startswith("suffix") for s in suffix)
        assert sum(s["accepted"] for s in suffix[2:]) > 0  # it drafted, and was right


def test_sampling_with_suffix_drafts_matches_incremental_distribution(
    tiny_pair,  # noqa: F811
    tmp_path,
    counted_seeds,  # noqa: F811
):
    """Unseeded sampling (seeded requests get no suffix drafts) from a corpus that continues the
    prompt in several ways: the first three tokens' joint distribution is incremental's. The
    requests' generators are seeded from a counter (`counted_seeds`: unseeded, it failed once)."""
    target = tiny_pair[0]
    corpus = tmp_path / "corpus.jsonl"
    tails = [[0, 1, 2, 3], [4, 4, 5], [1, 1, 0], [2, 5, 3, 3]]
    corpus.write_text("".join(json.dumps(PROMPT + t) + "\n" for t in tails))
    engine = Engine(target, dtype="float32", max_batch_size=512, adaptive_tree=False,
                    ssm=[f"suffix:corpus={corpus},max_n=3,depth=3,nodes=6"])  # fmt: skip
    params = [SamplingParams(max_tokens=3, ignore_eos=True, **PARAMS) for _ in range(SAMPLES)]
    outs = engine.generate([PROMPT] * SAMPLES, params)
    counts = Counter(tuple(o.token_ids[:3]) for o in outs)
    stat, p = _chi_squared_p(counts, _exact_joint(Engine(target, dtype="float32"), **PARAMS),
                             SAMPLES)  # fmt: skip
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"
    accepted = sum(o.metrics["per_ssm"][0]["accepted"] for o in outs)
    print(f"\naccepted suffix drafts: {accepted} in {SAMPLES} requests")
    assert accepted > SAMPLES // 4  # whole trees (no cut): 14072 in one run


def test_dsi_with_suffix_drafts_equals_incremental(tiny_pair):  # noqa: F811
    target = tiny_pair[0]
    prompts = [PROMPT, [5, 5, 1, 0, 2], PROMPT, [5, 5, 1, 0, 2]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = Engine(target, dtype="float32").generate(prompts, params)
    with Engine(target, dtype="float32", ssm=["suffix"], mode="dsi", target_servers=1,
                lookahead=3) as engine:  # fmt: skip
        outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.metrics["dsi"]["accepted"] for o in outs[2:]) > 0  # it drafted, and was right
