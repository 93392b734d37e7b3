"""One request as the engine serves it: its tokens, status, cache row, generator and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from specinfer.sampling import Penalties, SamplingParams, TokenLogprob, make_generator
from specinfer.streaming import TextStream


class Status(Enum):
    WAITING = "waiting"  # queued, no cache row yet
    RUNNING = "running"  # has a row: prefilling its prompt (in chunks), then decoding
    FINISHED = "finished"


@dataclass
class Completion:
    """The result of one request. finish_reason: "stop" (EOS, a stop string, or a structured
    output complete), "length", or "abort" (aborted before it finished, or its grammar failed:
    logged). logprobs: one per token id, when the request's
    SamplingParams asked for them (else None); prompt_logprobs: one per prompt token, None for
    the first (nothing before it), when asked for."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the new text and tokens (and their
    logprobs, when asked for; the prompt's come with the first token)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache held


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stream: TextStream, max_len: int, vocab_size: int, device: torch.device,
                 eos_ids: frozenset[int] = frozenset()):  # fmt: skip
        self.request_id, self.prompt_ids, self.params, self.stream = (
            request_id, prompt_ids, params, stream)  # fmt: skip
        self.max_len = max_len  # prompt + generated tokens allowed
        # On the device the logits live on: torch draws with a generator of the tensor's device.
        self.generator = make_generator(params.seed, device)
        self.penalties = Penalties(params, prompt_ids, vocab_size, eos_ids)  # checks token ids
        self.stop_token_ids = frozenset(params.stop_token_ids)  # end it as EOS does
        self.grammar = None  # a structured.Grammar, set by the engine when params ask for one
        self.status = Status.WAITING
        self.row = -1  # its row in the SSMs' caches
        self.blocks: list[int] = []  # its blocks of the target's cache
        self.registered_blocks = 0  # its first blocks that the prefix cache knows
        self.digests: list[bytes] = []  # of its full blocks of tokens (prefix_cache.digest)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache (first admission)
        self.num_computed = 0  # prefill tokens whose K/V are in the cache (chunked prefill)
        self.prefill_len = len(prompt_ids)  # tokens a prefill feeds (more after a preemption)
        self.preemptions = 0
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.text = ""
        self.finish_reason: str | None = None
        self.arrival = time.perf_counter()
        # Decode steps (target forwards after prefill), time per phase, and how often a node
        # at each tree depth was accepted.
        self.metrics = {"prefill_s": 0.0, "steps": 0, "ssm_s": 0.0, "target_s": 0.0, "verify_s": 0.0,
                        "commit_s": 0.0, "tree_nodes": 0, "accepted_per_depth": [], "per_ssm": [],
                        "weight_bytes": 0.0, "stream_s": 0.0, "stream_wait_s": 0.0}  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end], without joining them."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - p, 0) : max(end - p, 0)]

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill feeds: the prompt, and after a preemption the output too, but its
        newest token (which the next decode step feeds)."""
        return (self.prompt_ids + self.output_ids)[: self.prefill_len]

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's logprobs are still to be taken (not after a preemption)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= self.prefill_len

    @property
    def num_cached(self) -> int:
        """Positions whose K/V are in the target's cache (decoding: all but the newest token)."""
        return self.num_tokens - 1 if self.prefilled else self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def completion(self) -> Completion:
        m = dict(self.metrics)
        m["per_ssm"] = [dict(s) for s in m["per_ssm"]]
        m["generated_tokens"] = len(self.output_ids)
        m["cached_tokens"] = self.cached_tokens
        m["decode_s"] = m["ssm_s"] + m["target_s"] + m["verify_s"] + m["commit_s"]
        # The prefill yields the first token; each decode step yields the rest.
        m["tokens_per_step"] = (len(self.output_ids) - 1) / m["steps"] if m["steps"] else 0.0
        return Completion(self.text, self.output_ids, self.finish_reason or "length",
                          len(self.prompt_ids), m, self.logprobs, self.prompt_logprobs)  # fmt: skip
