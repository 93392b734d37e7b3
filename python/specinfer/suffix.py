"""Suffix drafts: continuations of the context's longest suffix in the tokens of earlier requests.

Prompt lookup ("ngram") searches the request itself; this drafter searches what the engine has
served before (prompt + output of every request that left its row), where a model's answers to
similar questions repeat whole phrases (SuffixDecoding, REST). It finds the longest n-gram
(n from max_n down to 1) that ends the context and occurs in that history (twice, if some
suffix does), and proposes what followed those occurrences as a tree, grown best first (as
SuffixDecoding does): a node's token has a share of the occurrences its parent's path kept, a
path is worth the product of its shares, and the `nodes` most worthy paths, up to `depth`
tokens, make the tree. So it branches where the earlier continuations split, at any depth (two
chains of 8 tokens each, branching at the root only, gave n-gram + suffix 2.38-2.40 tokens a step
on the 60 held-out prompts; this tree 2.48, bench_spec.py --sections paired).

The proposals are point masses (lossless at any temperature), but they depend on other
requests, so a seeded sampling request, whose seed must reproduce its output whatever was
served before, gets no suffix drafts.

History is bounded: drafting follows an n-gram's latest MATCHES occurrences, and past
`history` served tokens the older half of them is forgotten. The served index holds no container
per n-gram (each n-gram maps to its latest position, each position links to the one before with
the same n-gram, in one array per n): Python's garbage collector walks every list it tracks, and
with a list per n-gram a 318k-token corpus made 0.6M of them, so each full collection stalled the
step it fell in by 0.2-0.3 s (a suffix drafter timed in such a step looked 90 ms slow and was
stopped for good).

It can start from a corpus: a file of the target's token sequences, one JSON list of ids a line
(e.g. its own answers to prompts like those it will serve; benchmarks/make_suffix_corpus.py
writes one), gzip-compressed if its name ends in .gz. A corpus is indexed at once (`Corpus`) and
kept whatever `history` is. Spec strings: "suffix", or "suffix:" followed by key=value pairs
from max_n, depth, nodes, history, corpus, e.g. "suffix:max_n=4,depth=6,corpus=answers.jsonl".
"""

from __future__ import annotations

import copy
import gzip
import heapq
import json
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np

from specinfer.budget import must_draft
from specinfer.ngram import parse_options, require_positive
from specinfer.tree import TokenTree

MATCHES = 64  # occurrences kept per n-gram (the latest) and followed when drafting
END = -1  # between sequences in the history: no continuation runs past it


@dataclass(frozen=True)
class SuffixConfig:
    max_n: int = 6
    depth: int = 8
    nodes: int = 16  # the tree's size, root not counted
    history: int = 1 << 19  # served tokens remembered (their index takes ~0.35 KB a token)
    corpus: str = ""  # a file of token sequences the history starts with (always kept)

    def __post_init__(self):
        require_positive(self, "suffix", ["max_n", "depth", "nodes", "history"])

    @property
    def num_nodes(self) -> int:
        return 1 + self.nodes

    @classmethod
    def parse(cls, spec: str) -> SuffixConfig:
        return cls(**parse_options(spec, "suffix", cls))


class History:
    """Sequences one after another with END between them: a corpus indexed once (`Corpus`), then
    the served ones, indexed as they come: per n-gram the positions of the tokens after it, as
    a chain from the latest back."""

    def __init__(self, max_n: int, capacity: int, corpus: list[list[int]] = ()):
        self.max_n, self.capacity = max_n, capacity
        self.corpus = Corpus(corpus, max_n)
        self.tokens = array("i", self.corpus.tokens.tobytes())
        self.start = len(self.tokens)  # the first served position
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest served position
        # before[n - 1][p - start]: the served position before p after the same n-gram of n
        # tokens (-1: none)
        self.before = [array("i") for _ in range(max_n)]

    def add(self, seq: list[int]) -> None:
        if len(self.tokens) - self.start + len(seq) + 1 > self.capacity:
            self._forget_older_half()
        base = len(self.tokens)
        self.tokens.extend(seq)
        self.tokens.append(END)
        for e in range(len(seq)):  # the n-grams ending before seq[e]
            for n, before in enumerate(self.before, start=1):
                if n > e:
                    before.append(-1)
                    continue
                key = tuple(seq[e - n : e])
                before.append(self.latest.get(key, -1))
                self.latest[key] = base + e
        for before in self.before:  # END: no n-gram is followed by it
            before.append(-1)

    def _occurrences(self, key: tuple[int, ...], run: tuple[int, int] | None) -> list[int]:
        """The positions after `key`'s latest MATCHES occurrences, oldest first: served ones,
        then the corpus's (its `run`, None if it has none) while fewer than MATCHES."""
        before, found = self.before[len(key) - 1], []
        p = self.latest.get(key, -1)
        while p >= 0 and len(found) < MATCHES:
            found.append(p)
            p = before[p - self.start]
        if run is not None and len(found) < MATCHES:
            return self.corpus.latest(run, MATCHES - len(found)) + found[::-1]
        return found[::-1]

    def _longest_match(self, context: list[int]) -> list[int]:
        """The occurrences of the longest suffix of `context` seen here at least twice, else of
        the longest seen once: one earlier occurrence of a long n-gram says less than several of
        a shorter one (n-gram + suffix on the 60 held-out prompts: 2.53 tokens a step against
        2.48 taking the longest seen once, bench_spec.py --sections paired)."""
        runs = self.corpus.runs(context)
        once: list[int] = []
        for n in range(min(self.max_n, len(context)), 0, -1):
            found = self._occurrences(tuple(context[-n:]), runs[n - 1] if n <= len(runs) else None)
            if len(found) >= 2:
                return found
            once = once or found
        return once

    def _forget_older_half(self) -> None:
        """Of the served sequences; the corpus stays."""
        cut = self.start + max(1, (len(self.tokens) - self.start) // 2)
        while cut < len(self.tokens) and self.tokens[cut - 1] != END:  # at a sequence's start
            cut += 1
        kept = self.tokens[cut:]
        del self.tokens[self.start :]
        self.latest = {}
        self.before = [array("i") for _ in range(self.max_n)]
        start = 0
        for i, token in enumerate(kept):
            if token == END:
                self.add(kept[start:i].tolist())
                start = i + 1

    def tree(self, context: list[int], depth: int, nodes: int,
             chain: bool = False) -> list[tuple[int, int, float]]:  # fmt: skip
        """What followed the suffix of `context` `_longest_match` finds, as a tree of up to `nodes`
        nodes, up to `depth` deep, grown best first: per node (its parent's index in the list,
        -1 for the root; its token; its share of the occurrences its parent's path kept, the
        drafter's confidence), parents first, a node's children most worthy first. `chain`:
        the most worthy path alone (sequence mode)."""
        positions = self._longest_match(context)
        if not positions:
            return []
        out, frontier, order = [], [], count()

        def offer(parent: int, alive: list[int], offset: int, worth: float) -> None:
            """The children of the node `parent` (the occurrences `alive` still follow, `offset`
            tokens on), onto the frontier by the worth of their paths."""
            counts = Counter(self.tokens[p + offset] for p in alive)
            counts.pop(END, None)  # an end of a sequence counts against every token
            for token, seen in counts.items():
                share = _share(seen, len(alive))
                heapq.heappush(frontier, (-worth * share, next(order), parent, token, share,
                                          alive, offset))  # fmt: skip

        offer(-1, positions, 0, 1.0)
        while frontier and len(out) < nodes:
            worth, _, parent, token, share, alive, offset = heapq.heappop(frontier)
            if chain:  # the most worthy path only
                frontier.clear()
            out.append((parent, token, share))
            if offset + 1 < depth:
                kept = [p for p in alive if self.tokens[p + offset] == token]
                offer(len(out) - 1, kept, offset + 1, -worth)
        return out


def _share(count: int, total: int) -> float:
    """count of total occurrences, shrunk towards 0 by one unseen occurrence: a single match
    says less than ten that agree."""
    return count / (total + 1)


class Corpus:
    """A corpus's n-gram occurrences, indexed at once (numpy: ~0.15 s for the default corpus's
    536k tokens, which took ~4 s added one n-gram at a time): its positions that a token fills,
    sorted by the up to max_n tokens before each, the nearest first (a suffix array of the
    reversed text, cut at max_n), then by position. So the occurrences of any n-gram of up to
    max_n tokens are one run of that order, and each further token of context narrows the run
    by a binary search. Never changes once built."""

    def __init__(self, seqs: list[list[int]], max_n: int):
        self.max_n = max_n
        flat = [END] * max_n  # max_n ENDs in front: every position has max_n tokens before it
        for seq in seqs:
            flat += seq
            flat.append(END)
        tokens = np.array(flat, dtype=np.int32)
        self.tokens = tokens[max_n:]  # as the history numbers them
        filled = np.flatnonzero(tokens != END)
        # 16-bit keys where the tokens fit (END + 1 = 0): numpy sorts those by radix, ~4x faster
        dtype = np.uint16 if tokens.max() + 1 < 1 << 16 else np.int32
        before = [(tokens[filled - k] + 1).astype(dtype) for k in range(max_n, 0, -1)]
        self.order = filled[np.lexsort(before)]  # lexsort: last key first; stable
        # keys[n - 1][i]: the n-th token before order[i]; sorted within each run of the n - 1
        # before it, so a run narrows by binary search within it
        self.keys = [array("i", tokens[self.order - n].tobytes()) for n in range(1, max_n + 1)]

    def __deepcopy__(self, memo):
        return self  # immutable

    def runs(self, context: list[int]) -> list[tuple[int, int]]:
        """Per n from 1: the run of `order` whose positions follow `context`'s last n tokens,
        while there is one."""
        runs = []
        lo, hi = 0, len(self.order)
        for n in range(1, min(self.max_n, len(context)) + 1):
            keys, token = self.keys[n - 1], context[-n]
            lo, hi = bisect_left(keys, token, lo, hi), bisect_right(keys, token, lo, hi)
            if lo == hi:
                break
            runs.append((lo, hi))
        return runs

    def latest(self, run: tuple[int, int], k: int) -> list[int]:
        """The run's latest k positions (in the history's numbering), oldest first."""
        positions = self.order[run[0] : run[1]]
        if len(positions) > k:
            positions = np.partition(positions, len(positions) - k)[len(positions) - k :]
        return (np.sort(positions) - self.max_n).tolist()


class SuffixDrafter:
    """Drafts from the engine's earlier requests; same draft/commit interface as the Speculator.
    The history outlives batches: it is the engine's, not a request's."""

    samples_children = False  # point masses
    sized = False  # its depth comes from its config, not from the budget

    def __init__(self, config: SuffixConfig, vocab_size: int, name: str = "suffix",
                 chains: bool = False):  # fmt: skip
        self.config = config
        self.chains = chains  # sequence mode: one path, not a tree
        self.name = name
        corpus = read_corpus(config.corpus, vocab_size) if config.corpus else []
        self.history = History(config.max_n, config.history, corpus)
        self.rows: list[list[int]] = []  # per row: the tokens of the request on it, as last seen

    @property
    def num_nodes(self) -> int:
        return self.config.num_nodes

    def reset(self, rows: int, max_seq_len: int) -> None:
        for row in range(len(self.rows)):
            self.admit(row)
        self.rows = [[] for _ in range(rows)]

    def admit(self, row: int) -> None:
        """A new request takes `row`: the one that had it joins the history."""
        if self.rows[row]:
            self.history.add(self.rows[row])
        self.rows[row] = []

    def prefill(self, batch: list, tokens: list[list[int]]) -> None:
        for r, seq in zip(batch, tokens):
            self.rows[r.row] = seq

    def rollback(self, row: int, length: int) -> None:
        self.rows[row] = self.rows[row][:length]  # a copy: the list is the caller's

    def draft(self, batch: list, tokens: list[list[int]], max_depths: list[int]) -> list[TokenTree]:
        trees = []
        for r, seq, max_depth in zip(batch, tokens, max_depths):
            self.rows[r.row] = seq
            tree = TokenTree(seq[-1])
            depth = min(self.config.depth, max_depth)
            if depth > 0 and not must_draft(r.params):
                ids = []
                found = self.history.tree(seq, depth, self.config.nodes, chain=self.chains)
                for parent, token, share in found:
                    ids.append(tree.propose_once(ids[parent] if parent >= 0 else 0, token, share))
            trees.append(tree)
        return trees

    @contextmanager
    def unrecorded(self):
        """What is served inside leaves no history (a benchmark's warm-up must not draft the
        answers it measures from themselves)."""
        saved = copy.deepcopy(self.history)
        yield
        self.history, self.rows = saved, [[] for _ in self.rows]

    def commit(self, batch, prefix, paths, trees, max_depths) -> None:
        """Nothing to keep: the row's tokens are read again at the next draft."""


def read_corpus(path: str | Path, vocab_size: int) -> list[list[int]]:
    """Token sequences, one JSON list of ids (in the target's vocabulary) a line; gzip-compressed
    if the name ends in .gz."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suffix corpus not found: {path}")
    try:
        data = path.read_bytes()
        text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode()
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a broken .gz, or not text
        raise ValueError(f"{path}: not a corpus of JSON lines ({e})") from None
    seqs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            seq = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
        if not isinstance(seq, list) or not all(type(t) is int for t in seq):
            raise ValueError(f"{path}:{number}: expected a JSON list of token ids")
        if seq and (min(seq) < 0 or max(seq) >= vocab_size):
            raise ValueError(f"{path}:{number}: token ids outside the vocabulary [0, {vocab_size})")
        seqs.append(seq)
    return seqs
