"""Incremental detokenization with stop strings.

Byte-level BPE tokens can split a UTF-8 character, and a stop string can span several tokens, so
text is released only when it is final: complete characters that cannot be the start of a stop
string. Decoding works on a short window of recent tokens, so each step costs O(window), not O(n).
"""

from __future__ import annotations

from specinfer.tokenizer import TokenizerWrapper


class TextStream:
    def __init__(self, tokenizer: TokenizerWrapper, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.released = 0  # characters of self.text already handed out
        # Tokens before `start` are in self.text for good (self.text[:start_len]). The window is
        # decoded with the few tokens before it as context (`context` .. `start`), because some
        # decoders (SentencePiece) drop a leading space when a token is decoded first.
        self.context = self.start = self.start_len = 0
        self.context_text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the text that became final (may be empty)."""
        self.ids.append(token_id)
        window = self.tokenizer.decode(self.ids[self.context :])
        if window.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for more bytes
            return ""
        self.text = self.text[: self.start_len] + window[len(self.context_text) :]
        if len(self.ids) - self.start > 8:  # slide the window once its text is complete
            self.context, self.start, self.start_len = self.start, len(self.ids), len(self.text)
            self.context_text = self.tokenizer.decode(self.ids[self.context : self.start])
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: release whatever is still held back."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        search_from = max(0, self.released - self.holdback)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            end = len(self.text)
        else:
            end = len(self.text) if final else max(self.released, len(self.text) - self.holdback)
        out, self.released = self.text[self.released : end], end
        return out
