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


class CompletionLogprobs:
    """One choice's logprobs in the completions API's shape, a chunk at a time: text offsets run
    on from chunk to chunk (an echoed prompt's tokens first). `top`: the most likely tokens a
    step reports (0: none, top_logprobs null)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top, self.offset = tokenizer, top, 0

    def chunk(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """entries[i] scores token_ids[i]; None for a prompt's first token (nothing before it)."""
        tokens = [_text(self.tokenizer, t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        best = None
        if self.top:
            best = [None if e is None else {_text(self.tokenizer, t): lp for t, lp in e.top}
                    for e in entries]  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [e and e.logprob for e in entries],
                "top_logprobs": best, "text_offset": offsets}  # fmt: skip


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
