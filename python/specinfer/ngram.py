"""Prompt lookup: an SSM without a model that copies continuations from the request itself.

For each request it finds earlier occurrences of the sequence's last n tokens (n from max_n down
to min_n) in the request's own tokens (prompt + generated) and proposes the tokens that followed
them: the most recent match as a chain, or up to `branches` distinct continuations of several
matches as a tree. The proposals are a deterministic function of the context, so they are point
masses for VerifyStochastic (q row -1): lossless at any temperature.

Each request keeps an index n-gram -> positions after it, extended by the tokens added since the
last step, so a step costs O(new tokens + depth * branches), not O(context).

Spec strings: "ngram", or "ngram:" followed by comma-separated key=value pairs from max_n,
min_n, depth, branches, e.g. "ngram:max_n=4,depth=8,branches=2".
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from specinfer.tree import TokenTree

SCAN_LIMIT = 16  # matches looked at per n-gram size when collecting distinct continuations


@dataclass(frozen=True)
class NgramConfig:
    # Only max_n-token matches by default: on the training prompts' chat answers a 3-gram's
    # continuation is right 87% of the time at depth 1 and 56% at depth 8, a 1-gram's 23% and 3%.
    # Past 3 tree rows each row costs ~0.3 of a decode step (2 CPU cores), so shorter matches cost
    # more than they give (bench_spec ngrams, commit 78cba3c: min_n=1 27.8 ms/token, min_n=3
    # 19.1, incremental 19.8).
    max_n: int = 3
    min_n: int | None = None  # None: max_n
    depth: int = 8
    branches: int = 1

    def __post_init__(self):
        if self.min_n is None:
            object.__setattr__(self, "min_n", self.max_n)
        require_positive(self, "ngram", [f.name for f in fields(self)])
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n={self.min_n} is larger than max_n={self.max_n}")

    @property
    def num_nodes(self) -> int:
        return 1 + self.depth * self.branches

    @classmethod
    def parse(cls, spec: str) -> NgramConfig:
        """'ngram' or 'ngram:max_n=3,depth=5,branches=2'."""
        return cls(**parse_options(spec, "ngram", cls))


def require_positive(config, kind: str, names: list[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{kind} {name} must be a positive integer, got {value!r}")


def parse_options(spec: str, kind: str, config: type) -> dict[str, int | str]:
    """The options of a drafter spec 'KIND' or 'KIND:key=value,...' whose keys are the fields of
    the dataclass `config`: integers, but for its string fields."""
    name, _, options = spec.partition(":")
    if name != kind:
        raise ValueError(f"not a {kind} spec: {spec!r}")
    known = {f.name: f.type for f in fields(config)}
    kwargs = {}
    for item in filter(None, options.split(",")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if key not in known or not eq:
            raise ValueError(
                f"bad {kind} option {item!r} in {spec!r}; use key=value with keys {sorted(known)}"
            )
        if known[key] in (str, "str"):
            kwargs[key] = value
            continue
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise ValueError(f"{kind} option {key} must be an integer, got {value!r}") from None
    return kwargs


class _Index:
    """n-gram -> end positions e (the n-gram is seq[e-n:e]) that have a next token seq[e]."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.length = 0  # seq[:length] is indexed: every n-gram ending before length - 1

    def extend(self, seq: list[int]) -> None:
        for e in range(max(1, self.length), len(seq)):
            for n in self.sizes:
                if e >= n:
                    self.ends.setdefault(tuple(seq[e - n : e]), []).append(e)
        self.length = len(seq)

    def truncate(self, length: int) -> None:
        """Forget the n-grams of tokens past the first `length` (they may change)."""
        if length >= self.length:
            return
        for key in list(self.ends):
            ends = self.ends[key]
            while ends and ends[-1] >= length:
                ends.pop()
            if not ends:
                del self.ends[key]
        self.length = length


class NgramDrafter:
    """Drafts from each request's own tokens; same draft/commit interface as the Speculator."""

    samples_children = False  # its proposals are point masses
    sized = False  # its depth comes from its config, not from the budget

    def __init__(self, config: NgramConfig, name: str = "ngram"):
        self.config = config
        self.name = name
        self.indexes: list[_Index] = []

    @property
    def num_nodes(self) -> int:
        return self.config.num_nodes

    def reset(self, rows: int, max_seq_len: int) -> None:
        self.indexes = [self.new_index() for _ in range(rows)]

    def admit(self, row: int) -> None:
        self.indexes[row] = self.new_index()

    def prefill(self, batch: list, tokens: list[list[int]]) -> None:
        """Index each request's prompt now rather than at its first draft."""
        for r, seq in zip(batch, tokens):
            self.indexes[r.row].extend(seq)

    def rollback(self, row: int, length: int) -> None:
        self.indexes[row].truncate(length)

    def draft(self, batch: list, tokens: list[list[int]], max_depths: list[int]) -> list[TokenTree]:
        trees = []
        for r, seq, max_depth in zip(batch, tokens, max_depths):
            index = self.indexes[r.row]
            index.extend(seq)
            tree = TokenTree(seq[-1])
            conts = self.continuations(index, seq, min(self.config.depth, max_depth))
            ends = [0] * len(conts)
            for d in range(max(map(len, conts), default=0)):  # level by level, as SSMs number
                for i, cont in enumerate(conts):
                    if d < len(cont):
                        ends[i] = tree.propose_once(ends[i], cont[d])
            trees.append(tree)
        return trees

    def continuations(self, index: _Index, seq: list[int], depth: int) -> list[list[int]]:
        """Up to `branches` distinct continuations of the latest n-gram, most recent first,
        longest n-gram first."""
        found: list[list[int]] = []
        if depth < 1:
            return found
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if n >= len(seq):
                continue
            for e in reversed(index.ends.get(tuple(seq[-n:]), [])[-SCAN_LIMIT:]):
                cont = seq[e : e + depth]
                if cont not in found:
                    found.append(cont)
                    if len(found) == self.config.branches:
                        return found
        return found

    def commit(self, batch, prefix, paths, trees, max_depths) -> None:
        """Nothing to keep: the index catches up from the request's tokens at the next draft."""

    def new_index(self) -> _Index:
        return _Index(range(self.config.min_n, self.config.max_n + 1))
