"""Output handling: new tokens become text deltas; EOS, stop strings and length end a request."""

from __future__ import annotations

import logging

from specinfer.engine.sequence import RequestOutput, Sequence
from specinfer.sampling import TokenLogprob

log = logging.getLogger("specinfer.engine")


def append_tokens(seq: Sequence, tokens: list[int], eos_ids: set[int],
                  logprobs: list[TokenLogprob] | None = None) -> RequestOutput:  # fmt: skip
    """Append tokens (and their logprobs, if the request keeps them) until one of them
    finishes the request (the rest are dropped)."""
    delta, added = "", []
    for i, token in enumerate(tokens):
        if seq.grammar is not None and not seq.grammar.consume(token):
            log.warning("request %s ended: its grammar failed (%s)", seq.request_id,
                        seq.grammar.error)  # fmt: skip
            seq.finish_reason = "abort"
            delta += seq.stream.finish()
            break
        seq.output_ids.append(token)
        added.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs[i])
        is_eos = (token in eos_ids and not seq.params.ignore_eos) or token in seq.stop_token_ids
        if not is_eos:
            delta += seq.stream.add(token)
        if seq.stream.stopped or is_eos or (seq.grammar is not None and seq.grammar.stopped):
            seq.finish_reason = "stop"
        elif len(seq.prompt_ids) + len(seq.output_ids) >= seq.max_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            delta += seq.stream.finish()
            break
    seq.text += delta
    return output_of(seq, delta, added)


def output_of(seq: Sequence, delta: str = "", tokens: list[int] | None = None) -> RequestOutput:
    tokens = tokens or []
    logprobs = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(tokens) :]
    first = tokens and len(tokens) == len(seq.output_ids)
    return RequestOutput(seq.request_id, delta, tokens, seq.finish_reason is not None,
                         seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids),
                         logprobs, seq.prompt_logprobs if first else None,
                         seq.cached_tokens)  # fmt: skip
