"""Online serving at the engine level: requests that join and leave at every step, chunked
prefill, aborts, and the asyncio front. Every output must equal the same request run alone."""

import asyncio
import random

import pytest

from specinfer import Engine, SamplingParams
from specinfer.engine import AsyncEngine, model_runner
from test_budget import SteepCosts
from test_speculative import VOCAB, tiny_pair  # noqa: F401

SPEC = {"ssm": ["other", "ngram:max_n=2,depth=4"], "tree": ["2,1,1", None]}


def _spec_engine(tiny_pair, **kwargs):  # noqa: F811
    target, other = tiny_pair
    ssm = [other if s == "other" else s for s in SPEC["ssm"]]
    engine = Engine(target, dtype="float32", ssm=ssm, tree=SPEC["tree"], **kwargs)
    if engine.budget:  # cut at fixed prices: what is accepted must not depend on timings
        engine.budget = SteepCosts(steepness=0.005)
    return engine


def _requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 5, 9, 17, 33]))]
        out.append((prompt, SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True)))
    return out


def _run_online(engine: Engine, requests, seed: int) -> dict[str, list[int]]:
    """Add the requests one by one at random steps while the others decode; the tokens of each."""
    rng = random.Random(seed)
    pending, ids, tokens = list(requests), [], {}
    while pending or engine.has_unfinished():
        while pending and (not engine.has_unfinished() or rng.random() < 0.3):
            prompt, params = pending.pop(0)
            ids.append(engine.add_request(prompt, params))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("max_tokens_per_step", [512, 7])
def test_online_greedy_requests_equal_each_request_alone(tiny_pair, max_tokens_per_step):  # noqa: F811
    """32 greedy requests of mixed lengths arrive at random steps, 6 rows, speculation with cut
    trees; with a 7-token step budget long prompts prefill in chunks beside decoding ones."""
    requests = _requests(32, seed=1)
    alone = Engine(tiny_pair[0], dtype="float32", max_batch_size=1)
    expected = [alone.generate(p, sp)[0].token_ids for p, sp in requests]
    engine = _spec_engine(tiny_pair, max_batch_size=6, max_tokens_per_step=max_tokens_per_step)
    got = _run_online(engine, requests, seed=2)
    assert got == expected
    assert engine.kv.num_free == engine.kv.rows and not engine.has_unfinished()
    assert engine.stats()["spec_accepted_tokens_total"] > 0


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(tiny_pair):  # noqa: F811
    """Seeded sampling requests mixed with greedy and unseeded ones, arriving at random steps:
    each seeded one gives the tokens it gives alone."""
    rng = random.Random(3)
    seeded = [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
                SamplingParams(max_tokens=20, temperature=0.9, top_k=4, seed=s, ignore_eos=True))
              for s in range(8)]  # fmt: skip
    others = [(p, SamplingParams(max_tokens=15, temperature=t, ignore_eos=True))
              for (p, _), t in zip(_requests(8, seed=4), [0.0, 1.0] * 4)]  # fmt: skip
    engine = _spec_engine(tiny_pair, max_batch_size=5)
    alone = [engine.generate(p, sp)[0].token_ids for p, sp in seeded]
    mixed = seeded + others
    order = list(range(len(mixed)))
    rng.shuffle(order)
    got = _run_online(engine, [mixed[i] for i in order], seed=5)
    by_request = {i: tokens for i, tokens in zip(order, got)}
    assert [by_request[i] for i in range(len(seeded))] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_chunked_prefill_equals_whole_prefill(tiny_pair):  # noqa: F811
    prompts = [p for p, _ in _requests(6, seed=6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    whole = Engine(tiny_pair[0], dtype="float32").generate(prompts, params)
    chunked = Engine(tiny_pair[0], dtype="float32", max_tokens_per_step=3).generate(prompts, params)
    assert [c.token_ids for c in chunked] == [w.token_ids for w in whole]


def test_prompts_share_a_prefill_forward_only_when_padding_is_short(tiny_pair):  # noqa: F811
    """On a CPU a padding row costs what a real one does: prompts of 30 and 26 tokens share a
    forward (4 rows of padding), those of 12 and 1 run in their own; outputs as if alone."""
    assert model_runner.PREFILL_PADDING == 8
    prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((12, 30, 1, 26))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine(tiny_pair[0], dtype="float32")
    widths, forward_chains = [], engine.runner.forward_chains

    def spy(kv, seqs, chains, prefix, every_row=False):
        widths.append(sorted(len(c) for c in chains))
        return forward_chains(kv, seqs, chains, prefix, every_row)

    engine.runner.forward_chains = spy
    out = engine.generate(prompts, params)
    assert widths[:3] == [[26, 30], [12], [1]]  # then decode steps: [1, 1, 1, 1]
    alone = Engine(tiny_pair[0], dtype="float32")
    assert [o.token_ids for o in out] == [alone.generate([p], params)[0].token_ids for p in prompts]


def test_abort_frees_the_row_and_spares_the_others(tiny_pair):  # noqa: F811
    engine = _spec_engine(tiny_pair, max_batch_size=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = engine.generate([1, 2, 3], params)[0].token_ids
    keep = engine.add_request([1, 2, 3], params)
    doomed = engine.add_request([4, 4, 4, 4], params)
    waiting = engine.add_request([5], params)  # no row yet: 2 rows
    tokens = {keep: [], waiting: []}
    for _ in range(3):
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.token_ids
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    assert engine.abort(doomed) and not engine.abort(doomed)
    assert engine.kv.num_free == 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.token_ids
    assert tokens[keep] == expected
    assert tokens[waiting] == engine.generate([5], params)[0].token_ids
    assert engine.kv.num_free == 2


def test_bad_requests_are_refused_without_harm(tiny_pair):  # noqa: F811
    engine = _spec_engine(tiny_pair, max_batch_size=2, max_model_len=40)
    ok = engine.add_request([1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="has 50 tokens; .*max_model_len=40"):
        engine.add_request([1] * 50)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request([1], request_id=ok)
    with pytest.raises(ValueError, match="max_tokens_per_step must be at least 1"):
        Engine(tiny_pair[0], max_tokens_per_step=0)
    with pytest.raises(ValueError, match="kv_budget must be"):
        Engine(tiny_pair[0], kv_budget=10)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["generation_tokens_total"] == 5
    assert not engine.abort(ok)  # finished: its id is free again
    assert engine.add_request([1], SamplingParams(max_tokens=1), request_id=ok) == ok


def test_a_short_kv_budget_makes_requests_wait_then_preempts_and_stays_exact(tiny_pair):  # noqa: F811
    """5 requests whose prompts fit the pool together but whose outputs do not: the newest are
    preempted (recomputed later, prompt and output), every output (greedy and seeded sampling)
    equals the request run alone, incremental and speculative, and the pool ends empty. Their
    logprobs and prompt logprobs too: once each, whatever was recomputed."""
    target = tiny_pair[0]
    scored = {"ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    params = [SamplingParams(max_tokens=40, **scored),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, **scored)]  # fmt: skip
    prompts = [[1 + i % 5] * (3 + 4 * i) for i in range(5)]
    for kwargs in ({}, {"ssm": [tiny_pair[1], "ngram"], "tree": "2,1"}):
        alone = Engine(target, dtype="float32", **kwargs)  # a seed reproduces its config's output
        expected = [alone.generate(p, params[i % 2])[0] for i, p in enumerate(prompts)]
        engine = Engine(target, dtype="float32", max_batch_size=5, max_model_len=64,
                        kv_budget=128, **kwargs)  # fmt: skip
        ids = [engine.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
        outs, waited = {}, False
        logprobs, prompt_logprobs = {i: [] for i in ids}, {}
        while engine.has_unfinished():
            waited |= engine.stats()["waiting"] > 0 and engine.stats()["running"] > 0
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.token_ids)
                logprobs[out.request_id] += out.logprobs
                if out.prompt_logprobs is not None:
                    assert out.request_id not in prompt_logprobs  # with the first token only
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
            assert engine.stats()["kv_used_tokens"] <= engine.stats()["kv_capacity_tokens"]
        assert [outs[i] for i in ids] == [e.token_ids for e in expected], kwargs
        for i, e in zip(ids, expected):
            assert len(prompt_logprobs[i]) == len(e.prompt_logprobs) == e.prompt_tokens
            assert prompt_logprobs[i][0] is None and len(logprobs[i]) == len(e.logprobs) == 40
            got = [x.logprob for x in logprobs[i] + prompt_logprobs[i][1:]]
            want = [x.logprob for x in e.logprobs + e.prompt_logprobs[1:]]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert engine.stats()["preemptions_total"] > 0 and waited
        assert engine.stats()["kv_used_tokens"] == 0 and engine.kv.num_free == 5


def test_async_engine_serves_concurrent_requests(tiny_pair):  # noqa: F811
    engine = _spec_engine(tiny_pair, max_batch_size=4)
    requests = _requests(10, seed=7)
    expected = [engine.generate(p, sp)[0].token_ids for p, sp in requests]

    async def one(aeng, prompt, params, delay):
        await asyncio.sleep(delay)
        tokens, last = [], None
        async for out in aeng.generate(prompt, params):
            tokens += out.token_ids
            last = out
        assert last.finished and last.completion_tokens == len(tokens)
        return tokens

    async def early_exit(aeng):
        async for _ in aeng.generate([1, 2], SamplingParams(max_tokens=25, ignore_eos=True)):
            break  # a client that went away: the request is aborted

    async def main():
        aeng = AsyncEngine(engine)
        try:
            with pytest.raises(ValueError, match="is empty"):
                async for _ in aeng.generate([]):
                    pass
            results = await asyncio.wait_for(
                asyncio.gather(early_exit(aeng), *(one(aeng, p, sp, 0.01 * i)
                                                   for i, (p, sp) in enumerate(requests))),
                timeout=120)  # fmt: skip
            for _ in range(200):  # the abort reaches the engine thread
                if engine.stats()["running"] == 0:
                    break
                await asyncio.sleep(0.05)
            return results[1:]
        finally:
            await aeng.shutdown(5)

    assert asyncio.run(main()) == expected
    assert engine.kv.num_free == engine.kv.rows


def test_async_shutdown_ends_requests_in_flight(tiny_pair):  # noqa: F811
    """shutdown(timeout) stops admitting, and a request still running at the deadline ends
    with finish_reason "abort" (its client is told, its row freed)."""
    engine = Engine(tiny_pair[0], dtype="float32")

    async def main():
        aeng = AsyncEngine(engine)
        outs = []

        async def consume():
            async for out in aeng.generate([1, 2], SamplingParams(max_tokens=100, ignore_eos=True)):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.01)
        await aeng.shutdown(0)
        await asyncio.wait_for(task, timeout=30)
        with pytest.raises(RuntimeError, match="not accepting"):
            async for _ in aeng.generate([1]):
                pass
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert engine.kv.num_free == engine.kv.rows
