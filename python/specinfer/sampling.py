"""Sampling parameters, repetition penalties, and the one function that turns logits into the
distribution we sample.

Speculative verification must compare the *same* adjusted distributions the incremental sampler
draws from, so temperature / top-k / top-p are applied in exactly one place (`probabilities`),
and the penalties in exactly one other (`Penalties.apply`), which every caller runs first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specinfer import ops

MAX_LOGPROBS = 20  # most likely tokens a step may report (vLLM's default cap)
STRUCTURED = ("json_schema", "regex", "choice", "grammar")  # structured output: one at most


@dataclass
class SamplingParams:
    """How to decode one request.

    temperature 0 means greedy (argmax). top_k 0, top_p 1 and min_p 0 disable those filters
    (min_p: tokens less likely than min_p times the most likely one are left out).
    A stop string ends the output just before it; EOS ends it unless ignore_eos, and so does any
    of stop_token_ids (kept in token_ids, not in the text, as EOS). min_tokens: EOS (unless
    ignore_eos) and stop_token_ids cannot be generated before the output holds this many tokens
    (their logits are masked, in verification too); stop strings still end it (vLLM holds them
    back too).
    Penalties (applied to the logits before temperature, greedy decoding included):
    repetition_penalty (HF's definition; 1 = off) divides a positive logit and multiplies a
    negative one of every token seen in the prompt or the output; presence_penalty and
    frequency_penalty (the OpenAI API's, in [-2, 2]; 0 = off) subtract, from the logit of each
    token the output holds, the presence penalty once and the frequency penalty per occurrence.
    logprobs: None (off), or N in [0, MAX_LOGPROBS]: each generated token's log-probability
    under the model, and the step's N most likely tokens (see `token_logprobs`);
    prompt_logprobs: the same for every prompt token after the first.
    logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits after the
    penalties (the OpenAI API's; -100 in effect bans a token, 100 forces it).
    Structured output (at most one; see structured.py): json_schema (a dict or its JSON text;
    {"type": "object"} for any JSON object), regex, choice (a list of strings: the output is
    one of them) or grammar (a Lark grammar, llguidance's dialect). The output then matches it,
    and ends when it is complete (finish_reason "stop") unless max_tokens comes first.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of token ids (integers >= 0), got "
                             f"{self.stop_token_ids!r}")  # fmt: skip
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not (0 <= self.min_tokens <= self.max_tokens)
        ):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")  # fmt: skip
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100
                for t, b in self.logit_bias.items()
            ):  # fmt: skip
                raise ValueError("logit_bias must map token ids (integers >= 0) to biases in "
                                 f"[-100, 100], got {self.logit_bias!r}")  # fmt: skip
        self._check_structured()
        if self.min_tokens and self.structured_fields:  # a complete output allows EOS alone
            raise ValueError("min_tokens cannot be combined with structured output")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )

    def _check_structured(self) -> None:
        given = self.structured_fields
        if len(given) > 1:
            raise ValueError(
                f"give at most one of json_schema, regex, choice and grammar, got {given}"
            )
        if not isinstance(self.json_schema, (dict, str, type(None))):
            raise ValueError(
                f"json_schema must be a dict or a JSON string, got {self.json_schema!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):  # fmt: skip
            raise ValueError(
                f"choice must be a non-empty list of non-empty strings, got {self.choice!r}"
            )

    @property
    def structured_fields(self) -> list[str]:
        """The structured-output fields set (one at most, once checked)."""
        return [name for name in STRUCTURED if getattr(self, name) is not None]

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling: a penalty, a logit bias or min_tokens."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> torch.Tensor:  # fmt: skip
    """The distribution a sampler with these parameters draws from: softmax(logits / T), cut to the
    top-k tokens, to the smallest set whose mass reaches top_p, and to the tokens at least min_p
    times as likely as the most likely one, renormalised. logits [..., V]."""
    if temperature <= 0.0:
        raise ValueError("probabilities() needs temperature > 0; greedy decoding uses argmax")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # Keep a token if the mass before it (in descending order) is below top_p; the top token
        # always stays. Only the largest k probabilities are sorted, k growing until they hold
        # top_p (every later token then has at least that much before it): a full sort of the
        # vocabulary costs milliseconds a row. The kept ones, renormalised, are all that is
        # written into a zeroed row (passes over the vocabulary are what this costs).
        V, k = probs.shape[-1], min(probs.shape[-1], 32)
        while True:
            top, order = torch.topk(probs, k, dim=-1)
            mass = top.cumsum(-1)
            if k == V or bool((mass[..., -1] >= top_p).all()):
                break
            k = min(V, 8 * k)
        top = top.masked_fill(mass - top >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, top / top.sum(-1, keepdim=True))
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class TokenLogprob:
    """A generated token's log-probability, and the step's most likely (token, log-probability)
    pairs, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """tokens[i]'s TokenLogprob under row i of logits [N, V], with `top` most likely tokens.

    The model's own distribution, log_softmax of the raw logits: before penalties, temperature,
    top-k and top-p (vLLM's default), so a token's log-probability is the same however it was
    decoded. Under speculation the rows are the target's at the accepted path's nodes, the
    logits incremental decoding would have had there."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(-1, index)[:, 0].tolist()
    best = [[] for _ in tokens]
    if top:
        # Ties (common in bfloat16) in token order, as argmax breaks them: a greedy token is
        # its step's first. Every token that reaches the top-th value is a candidate.
        kth = lp.topk(top, dim=-1).values[:, -1]
        best = []
        for row, threshold in zip(lp, kth):
            ids = (row >= threshold).nonzero()[:, 0]
            order = torch.sort(row[ids], descending=True, stable=True).indices[:top]
            best.append(list(zip(ids[order].tolist(), row[ids[order]].tolist())))
    return [TokenLogprob(t, c, b) for t, c, b in zip(tokens, chosen, best)]


class Penalties:
    """The repetition penalties of one request, applied to logits given the tokens it holds,
    its logit bias, added after them, and min_tokens' mask of the tokens that end it.

    Under speculation each tree node's logits are penalised by the tokens of its own path: the
    request's committed output plus the node's branch (its ancestors below the root, and itself),
    which is exactly what incremental decoding would have seen at that point, so greedy
    verification and speculative sampling stay exact."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 eos_ids: frozenset[int] = frozenset()):  # fmt: skip
        self.params, self.vocab_size = params, vocab_size
        self.active = params.adjusts_logits  # callers skip building branches when False
        self.penalizes = params.penalized  # the bias alone needs no tokens
        self.prompt_tokens = None
        if self.penalizes:
            self.prompt_tokens = torch.tensor(prompt_ids, dtype=torch.long).unique()
        self.bias_ids = self.bias_by_token = None
        check_token_ids(params, vocab_size)
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self.bias_by_token = torch.zeros(vocab_size, dtype=torch.float32)
            self.bias_by_token[self.bias_ids] = torch.tensor(list(params.logit_bias.values()))
        # Tokens that would end the output, masked while it is shorter than min_tokens (EOS is
        # one unless ignore_eos).
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.stop_ids = torch.tensor(sorted(ending), dtype=torch.long)

    def apply(
        self,
        logits: torch.Tensor,
        output_ids: list[int],
        branches: list[list[int]] | None = None,
        vocab_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Penalised (and biased) float32 logits [N, C] (unchanged when neither is set). Row i follows
        output_ids + branches[i] (no branches: output_ids alone); column j is token
        vocab_ids[j] (default: token j). Only the columns of tokens the request holds change,
        so only those are computed (a tree's rows times the whole vocabulary would cost a
        speculative step more than its drafting). On the CPU a compiled kernel (~50 us, where
        the torch ops took ~370, for a tree of 4 rows over 49152 tokens; it runs for each SSM
        level and the target's tree, each step); elsewhere `apply_reference`."""
        if not self.penalizes:  # nothing to compile: no penalty set, or the bias alone
            return self.apply_reference(logits, output_ids, branches, vocab_ids)
        p = self.params
        out = ops.apply_penalties(logits, self.prompt_tokens, output_ids, branches or [], vocab_ids,
                                  self.vocab_size, p.repetition_penalty, p.presence_penalty,
                                  p.frequency_penalty)  # fmt: skip
        if out is None:
            return self.apply_reference(logits, output_ids, branches, vocab_ids)
        return self._finish(out, output_ids, branches, vocab_ids)

    def _finish(self, out: torch.Tensor, output_ids: list[int], branches: list[list[int]] | None,
                vocab_ids: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """out (float32, the caller's own) with the logit bias added to its biased columns, and
        the tokens that end the output masked in the rows where it is shorter than min_tokens
        (row i holds len(output_ids) + len(branches[i]) tokens)."""
        if self.bias_ids is not None:
            ids, by_token = self.bias_ids.to(out.device), self.bias_by_token.to(out.device)
            # A restricted head: the columns whose tokens are biased (tokens it lacks get none).
            cols = ids if vocab_ids is None else torch.isin(vocab_ids, ids).nonzero()[:, 0]
            out[:, cols] += by_token[cols if vocab_ids is None else vocab_ids[cols]]
        if len(output_ids) < self.params.min_tokens and len(self.stop_ids):
            held = [len(output_ids) + len(b) for b in branches] if branches else [len(output_ids)]
            rows = torch.tensor([i for i, n in enumerate(held) if n < self.params.min_tokens],
                                dtype=torch.long, device=out.device)  # fmt: skip
            stops = self.stop_ids.to(out.device)
            cols = stops if vocab_ids is None else torch.isin(vocab_ids, stops).nonzero()[:, 0]
            out[rows[:, None], cols[None, :]] = float("-inf")
        return out

    def apply_reference(self, logits, output_ids, branches=None, vocab_ids=None) -> torch.Tensor:
        """`apply` (arguments as there) in torch ops, on any device: the semantics the kernel
        is tested against."""
        p = self.params
        if not self.active:
            return logits
        if not self.penalizes:
            return self._finish(
                logits.to(torch.float32, copy=True), output_ids, branches, vocab_ids
            )
        branches = branches or []
        output = torch.tensor(output_ids, dtype=torch.long)
        extra = torch.tensor([t for b in branches for t in b], dtype=torch.long)
        in_prompt = torch.zeros(self.vocab_size, dtype=torch.bool)
        in_prompt[self.prompt_tokens] = True
        held = in_prompt.clone()
        held[output] = True
        held[extra] = True
        token_of = vocab_ids.cpu() if vocab_ids is not None else None
        cols = (held if token_of is None else held[token_of]).nonzero()[:, 0]
        tokens = cols if token_of is None else token_of[cols]
        rows = logits.shape[0]
        counts = torch.bincount(output, minlength=self.vocab_size)[tokens]
        counts = counts.to(torch.float32).expand(rows, -1).clone()
        if len(extra):  # each branch token counts in its row, at its column if it has one
            row = torch.tensor([i for i, b in enumerate(branches) for _ in b], dtype=torch.long)
            counts.index_add_(0, row, (extra[:, None] == tokens[None, :]).float())
        seen = in_prompt[tokens] | (counts > 0)
        cols, counts, seen = (t.to(logits.device) for t in (cols, counts, seen))
        out = logits.to(torch.float32, copy=True)
        x = out[:, cols]
        if p.repetition_penalty != 1.0:
            scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, scaled, x)
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        out[:, cols] = x
        return self._finish(out, output_ids, branches, vocab_ids)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the token ids (logit_bias's, stop_token_ids) a vocabulary of vocab_size
    lacks."""
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name}: token ids outside the vocabulary of {vocab_size}: "
                             f"{outside[:5]}")  # fmt: skip


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def draw_seed(generator: torch.Generator) -> int:
    """A seed drawn from `generator`: for the C++ verifiers, or to split off a generator."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, as torch.argmax), on every row a step
    verifies: `ops.argmax` (a compiled kernel on the CPU, torch.max elsewhere)."""
    return ops.argmax(logits)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from logits [V] under params."""
    if params.greedy:
        return int(greedy_tokens(logits))
    probs = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return int(torch.multinomial(probs, 1, generator=generator))
