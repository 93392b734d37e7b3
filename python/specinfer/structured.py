"""Structured output: a request's text held to a JSON schema, a regex, a choice of strings or a
grammar, by masking the tokens it may not emit next (llguidance computes the masks).

The mask is one more adjustment of the logits, after the penalties and before temperature, so
speculation stays exact as it does with penalties: each row of a verified tree is masked by the
grammar's state after that row's own path (`Grammar.mask_tree`), so it is the row incremental
decoding would sample from there. A node whose token the grammar forbids can never be accepted
(its masked probability is 0), so the rows below it are left as they are. The SSMs' drafts are
masked the same way (`Grammar.mask_nodes`), which only makes them likelier to be accepted.
"""

from __future__ import annotations

import json

import numpy as np
import torch


def grammar_source(params) -> str | None:
    """The llguidance grammar a request's SamplingParams ask for (None: unconstrained)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if params.json_schema is not None:
        return matcher.grammar_from_json_schema(params.json_schema)
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    if params.grammar is not None:
        return matcher.grammar_from_lark(params.grammar)
    return None


class GrammarCompiler:
    """Builds a request's Grammar against one tokenizer; the tokenizer's llguidance form is made
    on first use (0.3 s for the default model's 49k vocabulary here) and kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._llg_tokenizer = None

    def compile(self, params) -> Grammar | None:
        """The request's Grammar, or None when it asks for none; ValueError naming the field
        for a schema, regex or grammar llguidance rejects."""
        if not params.structured_fields:
            return None
        import llguidance

        try:
            source = grammar_source(params)
        except ValueError as e:  # a json_schema string that is not JSON
            raise ValueError(f"{params.structured_fields[0]} is not valid: {e}") from e
        if self._llg_tokenizer is None:
            if not self.eos_ids:
                raise ValueError("structured output needs a model with an EOS token")
            self._llg_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        error = llguidance.LLMatcher.validate_grammar(source, self._llg_tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{params.structured_fields[0]} is not valid: {error.strip()}")
        matcher = llguidance.LLMatcher(self._llg_tokenizer, source, log_level=0)
        return Grammar(matcher, self.vocab_size, set(self.eos_ids))


class Grammar:
    """One request's grammar state, after the tokens it generated so far. EOS is never fed to
    the matcher (llguidance cannot roll an EOS back): it ends the output, so nothing follows it.
    A matcher that fails (refuses a token its own mask allowed, or a rollback: a bug, ours or
    llguidance's) sets `error`; the engine then ends that request alone ("abort", logged)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: set[int]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self.ended = False
        self.error: str | None = None

    @property
    def stopped(self) -> bool:
        """The output is complete: EOS came, or the grammar allows nothing else."""
        return self.ended or self.matcher.is_stopped()

    def consume(self, token: int) -> bool:
        """Advance past a generated token; False (and `error` set) if the grammar refuses it."""
        if self.error is None and token in self.eos_ids and self.matcher.is_accepting():
            self.ended = True
        elif self.error is None and not self.matcher.consume_token(token):
            self.error = f"token {token} refused: {self.matcher.get_error()}"
        return self.error is None

    def allowed(self) -> torch.Tensor:
        """Bool [V]: the tokens the grammar allows next. Every token once the matcher failed
        (its request ends at its next token; an all-forbidden row would break sampling)."""
        if self.error is None:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8),
                                 bitorder="little")[: self.vocab_size]  # fmt: skip
            if bits.any():
                return torch.from_numpy(bits.astype(bool))
            self.error = f"the grammar allows no token: {self.matcher.get_error()}"
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar forbids next at -inf."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def mask_tree(self, logits: torch.Tensor, tree) -> torch.Tensor:
        """logits [N, V], one row per node of `tree` (rooted at the last token generated): each
        node's row masked by the state after its path. Rows below a forbidden token stay as
        they are (never on an accepted path)."""
        out = logits.clone()
        self._mask_below(out, tree, 0)
        return out

    def _mask_below(self, out: torch.Tensor, tree, node: int) -> None:
        allowed = self.allowed()
        out[node].masked_fill_(~allowed, float("-inf"))
        for token, child in tree.children[node].items():
            if allowed[token] and token not in self.eos_ids and self._take(token):
                self._mask_below(out, tree, child)
                self._rollback(1)

    def mask_nodes(self, logits: torch.Tensor, tree, nodes: list[int],
                   columns: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """A drafter's logits [len(nodes), C] for the children of `nodes` of a tree it is
        drafting, each masked by the state after the node's path (C: the vocabulary, or the
        token ids `columns` of a restricted head). A row with every column forbidden, or below a
        forbidden token, stays as it is: its drafts will be rejected, not decide anything."""
        out = logits.clone()
        for i, path in enumerate(tree.branches(nodes)):
            taken = self.matcher.try_consume_tokens(path)
            if taken == len(path):
                allowed = self.allowed()
                allowed = allowed if columns is None else allowed[columns]
                if allowed.any():
                    out[i].masked_fill_(~allowed, float("-inf"))
            if taken:
                self._rollback(taken)
        return out

    def _take(self, token: int) -> bool:
        if self.error is None and not self.matcher.consume_token(token):
            self.error = f"token {token} refused though allowed: {self.matcher.get_error()}"
        return self.error is None

    def _rollback(self, n: int) -> None:
        if self.error is None and not self.matcher.rollback(n):
            self.error = f"could not roll back {n} tokens: {self.matcher.get_error()}"
