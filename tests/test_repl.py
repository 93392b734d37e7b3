"""`specinfer chat`: turns read line by line, each answered with the conversation so far."""

import io
import sys

import pytest

from specinfer import Engine, SamplingParams
from specinfer.cli import main as cli_main
from specinfer.repl import converse
from test_speculative import tiny_pair  # noqa: F401

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _answer(engine, history) -> str:
    return engine.generate([history], GREEDY)[0].text


def test_chat_answers_each_turn_with_the_conversation_so_far(smollm_gguf, monkeypatch, capsys):
    """Three turns and a /reset through the CLI (default drafting, prefix cache): each answer is
    the one a fresh incremental engine gives the conversation so far; the second turn finds the
    first cached (--stats)."""
    monkeypatch.setattr(
        sys, "stdin", io.StringIO("Name a fruit.\n\nAnd a vegetable?\n/reset\nHi\n")
    )
    rc = cli_main(["chat", "--model", str(smollm_gguf), "--system", "Be brief.", "--temperature",
                   "0", "--max-tokens", "12", "--dtype", "float32", "--stats"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    plain = Engine(smollm_gguf, dtype="float32", prefix_caching=False)
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "Name a fruit."}]
    first = _answer(plain, history)
    history += [{"role": "assistant", "content": first},
                {"role": "user", "content": "And a vegetable?"}]  # fmt: skip
    second = _answer(plain, history)
    third = _answer(plain, [system, {"role": "user", "content": "Hi"}])
    assert out == f"{first}\n{second}\n{third}\n"
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 3 and "prompt tokens cached" in stats[1]


def test_a_long_conversation_drops_its_oldest_turns_and_a_turn_too_long_is_skipped(
    smollm_gguf, capsys
):
    engine = Engine(smollm_gguf, dtype="float32", max_model_len=128, mode="incremental")
    out = io.StringIO()
    turns = [f"Tell me about the number {i}." for i in range(6)]
    converse(engine, GREEDY, "Be brief.", lines=turns[:3] + ["word " * 200] + turns[3:], out=out)
    err = capsys.readouterr().err
    answers = out.getvalue().splitlines()
    assert len(answers) == 6 and all(answers)  # every turn but the one too long answered
    assert "its oldest turns were dropped" in err
    assert "serves up to max_model_len=128 tokens" in err  # the refused turn, named


def test_chat_needs_a_chat_template(tiny_pair):  # noqa: F811
    with pytest.raises(ValueError, match="needs a model with a chat template"):
        converse(Engine(tiny_pair[0], dtype="float32"), GREEDY, lines=["hi"], out=io.StringIO())


def test_a_refused_turn_leaves_the_conversation_as_it_was(smollm_gguf, capsys):
    engine = Engine(smollm_gguf, dtype="float32", max_model_len=256, mode="incremental")
    out = io.StringIO()
    converse(engine, GREEDY, lines=["Name a fruit.", "word " * 300, "Why?"], out=out)
    first, second = out.getvalue().splitlines()
    history = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Why?"}]  # fmt: skip
    assert second == _answer(engine, history)
    assert "serves up to max_model_len=256 tokens" in capsys.readouterr().err
