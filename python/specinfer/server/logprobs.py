"""The engine's TokenLogprobs in OpenAI's two shapes: chat's `{"content": [...]}` and the
completions API's parallel lists.

A token is shown as its own decoded text (special tokens included, so EOS shows as itself); a
token that holds part of a character decodes to U+FFFD, and its `bytes` are those of that text,
as vLLM does. Every generated token is listed, EOS and a stop string's tokens too, so the list
matches usage.completion_tokens rather than the (trimmed) text.
"""

from __future__ import annotations

from specinfer.sampling import TokenLogprob


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], top: int, offset: int = 0) -> dict:
    """`offset`: where the first token starts in the choice's text (a stream's earlier chunks)."""
    tokens = [_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    best = None
    if top:
        best = [{_text(tokenizer, t): lp for t, lp in e.top} for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": best, "text_offset": offsets}  # fmt: skip


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
