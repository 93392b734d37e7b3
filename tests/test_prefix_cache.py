"""Prefix caching: the cache's bookkeeping, the blocks a request takes and leaves, and outputs
that equal prefilling every prompt whole (greedy, incremental and speculative)."""

import random

import pytest

from specinfer import Engine, SamplingParams
from specinfer.engine.kv_manager import KVManager
from specinfer.engine.prefix_cache import ROOT, PrefixCache, digest
from specinfer.engine.sequence import Sequence
from test_speculative import (
    SAMPLED,
    SAMPLES,
    VOCAB,
    _chi_squared_p,
    _exact_joint,
    _sample_first3,
    tiny_pair,  # noqa: F401
)

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_prefix_cache_books_blocks_by_digest_and_evicts_the_least_recently_released():
    cache = PrefixCache()
    d1 = digest(ROOT, [1, 2])
    d2, other = digest(d1, [3, 4]), digest(ROOT, [3, 4])
    assert d2 != other and digest(ROOT, [1, 2]) == d1  # a block is known by all before it
    for block in (7, 8, 9):
        cache.hold(block)
    cache.register(7, d1)
    cache.register(8, d2)
    cache.register(9, d1)  # the same tokens twice: the first block keeps them
    assert cache.match([d1, d2, other]) == [7, 8]
    assert cache.match([other, d2]) == []  # from the first digest only
    cache.hold(7)  # a second sequence shares block 7
    assert [cache.release(b) for b in (9, 8, 7)] == [True, False, False]  # 9 was never cached
    assert list(cache.idle) == [8] and cache.holders == {7: 1}
    cache.release(7)
    assert list(cache.idle) == [8, 7]
    cache.hold(8)  # taken again: no longer idle
    assert cache.evict() == 7 and cache.match([d1]) == [] and cache.evict() is None
    assert cache.forget() == [] and cache.match([d2]) == []


class _Runner:
    def new_cache(self, blocks, block_len):
        return object()


def _seq(prompt: list[int], params=GREEDY) -> Sequence:
    return Sequence("r", prompt, params, None, 100, VOCAB, "cpu")


def _prefilled(kv: KVManager, prompt: list[int], params=GREEDY) -> Sequence:
    seq = _seq(prompt, params)
    assert kv.allocate(seq, len(prompt))
    seq.num_computed = seq.prefill_len
    return seq


def test_kv_manager_hands_out_cached_blocks_and_takes_idle_ones_back_last():
    kv = KVManager(_Runner(), None, rows=4, row_len=64, num_blocks=8, block_len=4,
                   device="cpu", prefix_caching=True)  # fmt: skip
    prompt = list(range(10))  # two full blocks of 4 and two tokens
    a = _prefilled(kv, prompt)
    head, tail, _ = a.blocks
    kv.free(a)  # its two full blocks stay cached; its third is free
    assert list(kv.prefix.idle) == [tail, head] and kv.used_tokens() == 0
    b = _seq(prompt[:6] + [9, 9, 9])
    assert kv.allocate(b, 9) and b.num_computed == 4 and b.blocks[0] == head
    c = _seq(prompt)  # all of a's full blocks; at least one token is left to prefill
    assert kv.allocate(c, 10) and c.num_computed == 8 and c.blocks[0] == b.blocks[0]
    assert kv.used_tokens() == 4 * (1 + 2 + 2)  # the shared block once
    kv.free(b)
    kv.free(c)
    whole = _seq(list(range(8)) + [5])  # 9 tokens: prefilled from the 9th
    assert kv.allocate(whole, 9) and whole.num_computed == 8
    kv.free(whole)
    exact = _seq(list(range(8)))  # both blocks cached, but its logits need a forward
    assert kv.allocate(exact, 8) and exact.num_computed == 4
    kv.free(exact)
    scored = _seq(prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert kv.allocate(scored, 10) and scored.num_computed == 0  # its prompt is prefilled whole
    kv.free(scored)
    # The pool (8 blocks and the scratch) runs short: idle blocks are taken, tail first.
    big = _seq([5] * 28)
    assert kv.allocate(big, 28) and tail in big.blocks and head not in big.blocks
    assert kv.prefix.match(a.digests[:1]) == [head] and kv.prefix.match(a.digests[1:2]) == []
    assert not kv.allocate(_seq([5] * 8), 8)  # nothing idle left but the head: refused whole
    assert kv.prefix.match(a.digests[:1]) == [head]


def _with_shared_prefix(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(37)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("spec", [{}, {"ssm": ["other", "ngram"], "tree": ["2,1,1", None]}],
                         ids=["incremental", "tree"])  # fmt: skip
def test_cached_prefixes_decode_as_whole_prefills(tiny_pair, spec):  # noqa: F811
    """Requests sharing a 37-token start, one at a time and then together, and a second turn
    that repeats a first's prompt and answer: greedy outputs equal prefilling each whole, and
    the prefixes were found (the answer's blocks too)."""
    target, other = tiny_pair
    spec = {**spec, "ssm": [other if s == "other" else s for s in spec.get("ssm", [])] or None}
    prompts = _with_shared_prefix(6, seed=3)
    whole = Engine(target, dtype="float32", prefix_caching=False, **spec)
    cached = Engine(target, dtype="float32", max_batch_size=4, **spec)
    expected = [whole.generate(p, GREEDY)[0] for p in prompts]
    got = [cached.generate(p, GREEDY)[0] for p in prompts[:2]] + cached.generate(
        prompts[2:], GREEDY
    )
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert got[0].metrics["cached_tokens"] == 0 and whole.stats()["prefix_cache_hits_total"] == 0
    assert all(g.metrics["cached_tokens"] >= 32 for g in got[1:])
    # Four requests of a new prompt at once: one prefills it, the others wait a step for it.
    (fresh,) = _with_shared_prefix(1, seed=8)
    together = cached.generate([fresh] * 4, GREEDY)
    alone = whole.generate(fresh, GREEDY)[0].token_ids
    assert [t.token_ids for t in together] == [alone] * 4
    blocks = 16 * ((len(fresh) - 1) // 16)
    assert sorted(t.metrics["cached_tokens"] for t in together) == [0, blocks, blocks, blocks]
    got += together
    prompts += [fresh] * 4
    # A new chat's first turn ending at position 63: its last token's K/V were never computed,
    # so the second turn finds its first 48 positions only.
    (chat,) = _with_shared_prefix(1, seed=4)
    first_params = SamplingParams(max_tokens=64 - len(chat), ignore_eos=True)
    first = cached.generate(chat, first_params)[0]
    assert first.token_ids == whole.generate(chat, first_params)[0].token_ids
    second = chat + first.token_ids + [1, 2, 3]
    turn = cached.generate(second, GREEDY)[0]
    assert turn.token_ids == whole.generate(second, GREEDY)[0].token_ids
    assert turn.metrics["cached_tokens"] == 48
    stats = cached.stats()
    got += [first, turn]
    assert stats["prefix_cache_hits_total"] == sum(g.metrics["cached_tokens"] for g in got)
    assert stats["prefix_cache_queries_total"] == sum(map(len, prompts + [chat, second]))
    assert stats["kv_used_tokens"] == 0 and cached.kv.num_free == 4


def test_sampling_from_cached_prefixes_matches_incremental_distribution(tiny_pair):  # noqa: F811
    """20,000 samples of one 41-token prompt, speculative with sampled children: nearly all but
    the first requests find its two full blocks cached; the first three tokens' joint
    distribution is the target's (chi-squared)."""
    target, other = tiny_pair
    (prompt,) = _with_shared_prefix(1, seed=6)
    exact = _exact_joint(Engine(target, dtype="float32"), prompt=prompt)
    engine = Engine(target, dtype="float32", max_batch_size=512, ssm=other, tree=SAMPLED)
    counts = _sample_first3(engine, prompt=prompt)
    assert engine.stats()["prefix_cache_hits_total"] >= 0.9 * SAMPLES * 32
    stat, p = _chi_squared_p(counts, exact, SAMPLES)
    print(f"\ncached prefixes, sampled children: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"


def test_a_short_pool_evicts_cached_prefixes_and_stays_exact(tiny_pair):  # noqa: F811
    """A pool of 12 blocks (3 requests' worth): concurrent requests take idle cached blocks,
    and preempted ones come back to their own cached blocks; outputs equal whole prefills."""
    target, other = tiny_pair
    prompts = _with_shared_prefix(8, seed=5) + [[3] * 20, [4] * 30]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = {"ssm": [other, "ngram"], "tree": ["2,1", None]}
    whole = Engine(target, dtype="float32", prefix_caching=False, **spec)
    expected = [whole.generate(p, params)[0].token_ids for p in prompts]
    engine = Engine(target, dtype="float32", max_batch_size=4, max_model_len=96, kv_budget=192,
                    **spec)  # fmt: skip
    got = [c.token_ids for c in engine.generate(prompts[:2], params)]
    got += [c.token_ids for c in engine.generate(prompts[2:], params)]
    assert got == expected
    stats = engine.stats()
    assert stats["preemptions_total"] > 0 and stats["prefix_cache_hits_total"] > 0
    assert stats["kv_used_tokens"] == 0 and engine.kv.num_free == 4


def test_prefix_caching_is_refused_where_it_cannot_apply(tiny_pair):  # noqa: F811
    with pytest.raises(ValueError, match="prefix_caching must be True, False or None"):
        Engine(tiny_pair[0], dtype="float32", prefix_caching="yes")
    with pytest.raises(ValueError, match="prefix_caching is not available with mode 'dsi'"):
        Engine(tiny_pair[0], dtype="float32", mode="dsi", ssm="ngram", prefix_caching=True)
    assert not Engine(tiny_pair[0], dtype="float32", prefix_caching=False).prefix_caching
    assert Engine(tiny_pair[0], dtype="float32").prefix_caching


@pytest.mark.parametrize("dtype, ssm", [("float32", "default"), ("bfloat16", "default"),
                                        ("bfloat16", "feature")])  # fmt: skip
def test_a_chats_later_turns_reuse_its_earlier_ones_default_model(smollm_gguf, dtype, ssm):
    """The default model, its chat template, its SSM or feature head and prompt lookup: each
    turn of two conversations sharing a system prompt equals the turn prefilled whole, and
    finds the turns before it cached."""
    system = {"role": "system", "content": "You are a terse assistant. Answer in one sentence."}
    questions = [["What is the capital of Peru?", "And of Chile?", "Which is further south?"],
                 ["Name a prime number.", "Is it odd?"]]  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0)
    engines = [Engine(smollm_gguf, dtype=dtype, ssm=[ssm, "ngram"], prefix_caching=on)
               for on in (False, True)]  # fmt: skip
    for chat in questions:
        history, earlier = [system], 0  # tokens of the turns before
        for question in chat:
            history.append({"role": "user", "content": question})
            whole, cached = (e.generate([history], params)[0] for e in engines)
            assert cached.token_ids == whole.token_ids, (dtype, history)
            if earlier:  # all but their last few tokens were found
                assert cached.metrics["cached_tokens"] >= earlier - 16 - 2
            history.append({"role": "assistant", "content": cached.text})
            earlier = cached.prompt_tokens + len(cached.token_ids)
    assert engines[1].stats()["prefix_cache_hits_total"] > 0
