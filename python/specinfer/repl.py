"""`specinfer chat`: a conversation on the terminal, a turn per line read.

Each turn sends the whole conversation through the chat template; the engine's prefix cache holds
the earlier turns, so a turn prefills only what is new (its question, and the previous answer as
the template writes it). When the conversation outgrows the context, the oldest exchanges are
dropped (the system prompt stays). Lines starting with "/" are commands: /reset, /exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from specinfer.sampling import SamplingParams

ROOM = 16  # tokens of the context left for an answer: a longer conversation loses old turns
HELP = "(/reset starts a new conversation, /exit or Ctrl-D ends; Ctrl-C stops an answer)"


def converse(engine, params: SamplingParams, system: str | None = None,
             report: Callable[[dict], str] | None = None, lines=None, out=None) -> None:  # fmt: skip
    """Read turns from `lines` (default: stdin, prompting on a terminal) and stream the answers
    to `out` (default: stdout). A turn the engine refuses (too long for the context) is
    reported on stderr and left out. report: a line of statistics for stderr per answer."""
    if not engine.tokenizer.chat_template:
        raise ValueError("specinfer chat needs a model with a chat template (this one has none)")
    out = out or sys.stdout
    interactive = lines is None and sys.stdin.isatty()
    if interactive:
        print(HELP, file=sys.stderr)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    for line in lines if lines is not None else _read(interactive):
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(start)
            continue
        if not text:
            continue
        answer, finished, turn = "", False, None
        try:
            turn, ids = _fit(engine, history + [{"role": "user", "content": text}], len(start))
            for delta in engine.stream(ids, params):
                answer += delta
                out.write(delta)
                out.flush()
            finished = True
        except KeyboardInterrupt:  # the stream's request is aborted as it closes
            if turn is None:  # before it started
                continue
        except ValueError as e:  # the conversation stays as it was
            print(f"specinfer: {e}", file=sys.stderr)
            continue
        out.write("\n")
        out.flush()  # before stderr's lines
        if len(turn) <= len(history):
            print("(the conversation outgrew the context: its oldest turns were dropped)",
                  file=sys.stderr)  # fmt: skip
        history = turn + [{"role": "assistant", "content": answer}]
        if report and finished:
            print(report(engine.last_metrics), file=sys.stderr)


def _read(interactive: bool):
    while True:
        try:
            yield input("> ") if interactive else next(sys.stdin)
        except (EOFError, StopIteration, KeyboardInterrupt):
            return


def _fit(engine, history: list[dict], kept: int) -> tuple[list[dict], list[int]]:
    """The conversation without its oldest exchanges (after the `kept` first messages) until
    it leaves an answer ROOM tokens of the context, and its token ids; ValueError (the
    engine's) when the new turn alone is longer than the context."""
    limit = engine.max_model_len - ROOM
    while True:
        alone = len(history) - kept <= 1  # nothing left to drop but the new turn
        try:
            ids = engine.prompt_ids(history)
            if len(ids) <= limit or alone:
                return history, ids
        except ValueError:  # longer than the context
            if alone:
                raise
        history = history[:kept] + history[kept + 2 :]
