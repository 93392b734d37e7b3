"""How much of the drafted trees is worth verifying: a cost-aware cut, learned while serving.

A node is worth its place in the target's tree forward when it raises the expected tokens per
second of the step. Its value is the chance that its whole path gets accepted: the product, down
the path, of each node's conditional acceptance rate (its parent accepted), estimated per
drafter, depth and rank among its siblings (a drafter's top-1 child is accepted far more often
than its top-2) from the verifications so far; or, where the drafter said how sure it was (an
SSM's probability of the token, the suffix drafter's share of matches), per drafter and bin of
that confidence, so a tree is cut where its drafter grows unsure, and the width follows how sure
the drafts of each step are. The step's cost is the target forward's time for the
batch at a given tree width (measured, per width) plus what the step spends besides (drafting,
verification, commit). `choose` keeps, per request, the most valuable nodes, as many as the
width that maximises expected tokens / step time.

When a batch may be cut is decided here too (`choose`). Lossless: the cut depends on depths and
drafters, never on a sampled token, and it only applies to trees of point-mass proposals (greedy,
top-k children, prompt lookup): those may be dropped for any reason. A tree with a sampled child
is verified whole, since dropping some of a node's i.i.d. draws depending on what they drew would
bias verification. And a seeded sampling request's tree is verified whole: a seed must
reproduce its output, so its trees must not depend on timings (the others in its batch are still
cut). Forward costs are learned per row count (batch x width), so they carry over as requests
join and leave; width 1 (no speculation) is always a candidate, so when trees do not pay (large
batches on a CPU) a step becomes plain decoding by itself.

Drafting that only feeds the cut is time lost, so a drafter whose every node the cut dropped in its
last PATIENCE steps stops drafting for the requests that may be cut (`drafts`); it drafts again
after 2, then 4, ... 64 skipped steps, and resumes for good once it earns its place again (the text
became predictable, the batch shrank), judged the step after its retry (the retry's drafting
includes catching up). A retry that could not pay at the batch size (the drafter's nodes in a tree
like its last one, by the rates and costs learned since) is refused without drafting and backs off
the same way, unless the batch shrinks; so is one that could not earn back its catch-up (a stopped
SSM feeds what it skipped first, new prompts included; the time per token is learned at its
retries) within the steps it would wait before the next try. The cut prices a step with the
drafting already done (it is spent whatever is kept); whether drafting pays at all is the step's
expected tokens per second against plain decoding's (untimed, at most what the narrowest timed
forward cost: drafters are stopped on timings, not on guesses), which drafts nothing: where plain
decoding would have been faster, the step counts as one with every node cut for all its drafters.
And each drafter must earn its own drafting time: the step must be expected to be at least as fast
as without it (without its drafting time, the nodes only it proposed and the forward rows they
take), else it counts as cut too (a cheap drafter's accepted nodes, prompt lookup's, must not carry
an SSM that costs more than it adds). Of drafters that propose the same nodes, one leaves at a
time, and the others are judged without it. When all drafters stop, a step is plain decoding: no
SSM forward at all. Lossless for the same reason as the cut.

An SSM given no tree config drafts a tree whose depth is chosen here too, each step, from the
same costs (`depth`): its tree's levels have known widths (and a beam: how many of a level's
nodes get children), so the expected tokens of its k best nodes follow from the rates, and a
step drafting d levels costs d SSM levels (timed per SSM) plus the target forward at width
1 + k. Where extra rows are nearly free (weights streamed from disk, a GPU) trees grow deep;
where each row costs (this CPU, resident), they stay shallow.
Seeded sampling requests draft SEEDED_DEPTH levels: a fixed shape, whatever the timings.
"""

from __future__ import annotations

import bisect
import weakref
from itertools import accumulate

from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

PRIOR = 2.0  # pseudo-counts pulling a depth's rate towards the depth above (or 0.5 at depth 1)
# A proposal its drafter gives a confidence (its probability of the token) is priced by how often
# proposals of that drafter in the same confidence bin were accepted: on held-out text the
# default SSM's top-1 drafts with probability below 0.1 were accepted 8% of the time, those
# above 0.9 95% (EAGLE-2's observation), where its depth-1 rate pools them all at ~40%.
CONF_BINS = 10
DECAY = 0.98  # weight of the past per observed step: rates follow the text being generated
SMOOTH = 0.25  # weight of the newest timing of a width
# Per step, what a row count not timed that step costs above the next smaller count shrinks by
# this factor, if that count has at least half as many rows: a timing taken in a slow moment
# (another process, a cold cache) that priced its width out would otherwise never be taken again,
# and never corrected. So an unused width is tried again now and then (about every 50 steps
# where it costs half as much again). Only towards a near count: the next smaller of a rare
# wide forward (a whole tree for 16 requests) says little of its price.
STALE = 0.99
PATIENCE = 4  # drafted steps with every node cut before a drafter stops drafting
EXPLORE = (2, 64)  # skipped steps before a stopped drafter drafts again: first, and at most
SEEDED_DEPTH = 1  # levels a sized SSM drafts for a seeded sampling request


def _timing_average(old: float | None, new: float) -> float:
    """A timing's moving average: `new` weighs SMOOTH against the past (`old`; None: none yet),
    counted at most twice the past: a stall (a full garbage collection: 0.3 s where drafting took
    0.1 ms; another process) must not price a width or a drafter out for good (a stopped
    drafter's price is not timed again until it drafts, and a retry that cannot pay on paper
    does not draft). Real changes still come through, by up to 25% a step."""
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * min(new, 2 * old)


class TreeBudget:
    def __init__(self):
        # (drafter, depth, rank among the drafter's children of one parent) -> ...
        self.tested: dict[tuple[int, int, int], float] = {}  # ... times its parent was accepted
        self.accepted: dict[tuple[int, int, int], float] = {}  # ... and the node too
        self._rates: dict[tuple[int, int, int], float] = {}  # rate()'s answers since then
        self.cost: dict[int, float] = {}  # rows (batch x width) -> target forward seconds
        self._sorted_rows: tuple = (None, 0, [])  # (the cost dict, its size, its keys sorted)
        self._seen: set[tuple[int, int]] = set()  # shapes timed once (that run recorded a graph)
        self.rest = 0.0  # seconds a step spends outside the target forward and the drafting
        self.drafting = 0.0  # seconds per request a step that drafts spends drafting
        self.level_s: dict[int, float] = {}  # drafter -> seconds per request of one level
        # Per drafter, the last tree it proposed nodes in and its drafting seconds per request:
        # what a retry would gain (its nodes, valued by the rates as they are then: a stopped
        # drafter's rates drift back to their priors) and cost, before it drafts. Its own,
        # since while it is stopped the trees drafted hold none of its nodes.
        self._last_tree: dict[int, TokenTree] = {}
        self.draft_each: dict[int, float] = {}
        self._idle: dict[int, int] = {}  # drafter -> its last drafted steps with no node kept
        self._skipped: dict[int, int] = {}  # drafter -> steps skipped since it last drafted
        self._explore: dict[int, int] = {}  # drafter -> skipped steps before it drafts again
        # Drafter -> the batch size at which its retry was last refused (`_could_pay`): a
        # smaller batch asks again at once, without waiting out the back-off.
        self._refused: dict[int, int] = {}
        # Drafters drafting again this step after skipping some -> the tokens each feeds first
        # (its backlog): their drafting time includes catching up, so it does not say what their
        # drafting costs, but with the backlog it says what catching up costs: drafter ->
        # seconds per token fed, learned at its retries.
        self._resumed: dict[int, int] = {}
        self.catch_up_s: dict[int, float] = {}

    def rate(self, drafter: int, depth: int, rank: int = 0, contested: bool = False) -> float:
        """Conditional acceptance of a node `drafter` proposed at `depth` as its rank-th child of
        a parent (0: its best); `contested`: another drafter proposed a different child there (it
        disagrees, so the token is a harder one: two drafters' disagreeing nodes are not each as
        good as either alone). One seldom tested leans on the uncontested rate, on the depth above
        (rank 0; 0.5 at depth 1) or on the rank before, halved."""
        key = (drafter, depth, rank, contested)
        if key in self._rates:
            return self._rates[key]
        if contested:
            prior = self.rate(drafter, depth, rank)
        elif rank == 0:
            prior = 0.5 if depth == 1 else self.rate(drafter, depth - 1)
        else:
            prior = self.rate(drafter, depth, rank - 1) / 2
        return self._smoothed(key, prior)

    def confident_rate(self, drafter: int, conf_bin: int) -> float:
        """Conditional acceptance of a node `drafter` proposed with a confidence in bin
        `conf_bin` (at any depth or rank); seldom tested, the bin's middle."""
        key = (drafter, "conf", conf_bin)
        if key in self._rates:
            return self._rates[key]
        return self._smoothed(key, (conf_bin + 0.5) / CONF_BINS)

    def _smoothed(self, key: tuple, prior: float) -> float:
        """key's acceptance rate, pulled towards `prior` by PRIOR pseudo-counts; kept until a
        verification changes the counts."""
        self._rates[key] = (self.accepted.get(key, 0.0) + PRIOR * prior) / (
            self.tested.get(key, 0.0) + PRIOR
        )
        return self._rates[key]

    def values(self, tree: TokenTree, confident: bool = True) -> list[float]:
        """Each node's chance of being accepted (the root: 1); `confident`: priced by its
        drafter's confidence where it gave one, else by depth and rank alone."""
        best = [0.0] * len(tree)
        for child, source, kind, conf in zip(tree.prop_child, tree.prop_source, _kinds(tree),
                                             tree.prop_conf):  # fmt: skip
            rate = (self.confident_rate(source, _conf_bin(conf)) if confident and conf >= 0
                    else self.rate(source, tree.depths[child], *kind))  # fmt: skip
            best[child] = max(best[child], rate)
        value = [1.0]
        for n in range(1, len(tree)):  # parents come before children
            value.append(value[tree.parents[n]] * best[n])
        return value

    def choose(self, trees: list[TokenTree], params: list[SamplingParams],
               draft_s: list[float] | None = None) -> list[list[int]]:  # fmt: skip
        """Per tree (params: its request's), the node ids to keep (root included, parents before
        children). Trees that must stay whole (sampled children, seeded sampling) do, and the
        forward is at least as wide as the widest of them; the others share one width.
        draft_s: the seconds each drafter took to draft these trees (judges each one's worth)."""
        whole = [list(range(len(t))) for t in trees]
        fixed = [_must_stay_whole(t, p) for t, p in zip(trees, params)]
        if all(fixed):
            return whole
        floor = max((len(t) for t, f in zip(trees, fixed) if f), default=1)
        has_conf = any(c >= 0 for t in trees for c in t.prop_conf)
        cut = self._cut(trees, fixed, floor, confident=True, judged=not has_conf)
        if cut is None:
            return whole  # nothing timed yet: verify everything and learn
        # A drafter drafts before it knows how sure it will be, so whether its drafting pays is
        # judged by what its nodes are worth on an average step (by depth and rank): a drafter
        # unsure for a few steps in a row keeps drafting for the steps where it is sure. Without
        # any confidence in the trees the two cuts are one.
        judging = self._cut(trees, fixed, floor, confident=False, judged=True) if has_conf else cut
        self._note_idle(trees, *judging, floor, draft_s)
        return cut[0]

    def _cut(self, trees: list[TokenTree], fixed: list[bool], floor: int, confident: bool,
             judged: bool):  # fmt: skip
        """The cut at the width that maximises expected tokens per second (None: nothing timed
        yet), with what `_note_idle` judges it by: per tree its nodes best first (None: kept
        whole) and their values, and the expected tokens (None where plain decoding would be
        faster). `judged`: the cut drafters are judged by (it keeps each one's last tree)."""
        whole = [list(range(len(t))) for t in trees]
        widest = max(len(t) for t in trees)
        if self.estimate(len(trees), widest) <= 0:
            return None  # nothing timed yet (a step's rest and drafting are not a forward)
        orders: list[list[int] | None] = []
        values: list[list[float]] = []
        gains = [float(len(trees))] * widest  # gains[w - 1]: expected tokens at width w
        for tree, f in zip(trees, fixed):
            value = self.values(tree, confident)
            values.append(value)
            if f:  # kept whole at every width
                orders.append(None)
                gains = [g + sum(value[1:]) for g in gains]
                continue
            # Ties keep the smaller id, so a kept node's parent is always kept.
            order = sorted(range(1, len(tree)), key=lambda n: (-value[n], n))
            orders.append(order)
            top = list(accumulate((value[n] for n in order), initial=0.0))  # top[k]: best k nodes
            for width in range(1, widest + 1):
                gains[width - 1] += top[min(width - 1, len(order))]
            if judged:
                self._last_tree.update((source, tree) for source in tree.prop_source)
        best, best_score = widest, -1.0
        for width in range(floor, widest + 1):
            seconds = self.rest + self.drafting * len(trees) + self.estimate(len(trees), width)
            if gains[width - 1] / seconds > best_score:
                best, best_score = width, gains[width - 1] / seconds
        kept = [keep if order is None else sorted([0] + order[: best - 1])
                for keep, order in zip(whole, orders)]  # fmt: skip
        plain = len(trees) / max(self.rest + self._at_most(len(trees), 1), 1e-9)
        return kept, orders, values, gains[best - 1] if best_score > plain else None

    def _at_most(self, batch: int, width: int) -> float:
        """The target forward for `batch` trees of `width`, to judge drafters by: `estimate`,
        but where that is a lower bound below every timed row count, at most what the narrowest
        wider one cost. A fresh engine drafts from its first step: plain decoding has not run,
        and the lower bound priced it at a fraction of a tree's forward (10 ms really, 2.6 by
        the bound), which stopped every drafter on that guess."""
        rows = batch * width
        if any(r <= rows for r in self.cost):
            return self.estimate(batch, width)
        return min(
            (c for r, c in self.cost.items() if r > rows), default=self.estimate(batch, width)
        )

    def _note_idle(self, trees: list[TokenTree], kept: list[list[int]],
                   orders: list[list[int] | None], values: list[list[float]],
                   tokens: float | None, floor: int,
                   draft_s: list[float] | None) -> None:  # fmt: skip
        """Per drafter that proposed nodes in the trees that may be cut: whether it earned its
        drafting. `tokens` is the chosen step's expected tokens, None where plain decoding
        would have been faster (no drafter earned it); `floor` the width of the trees kept
        whole. A drafter earns it when the cut kept a node of it and, its drafting time known,
        the step is expected to be at least as fast (tokens per second) as without it: without
        its drafting time, the nodes only it proposed, and the rows they take in the forward
        (the cut keeps whatever was drafted, so a cheap drafter's good nodes can carry an
        expensive one's, e.g. prompt lookup and an SSM at 4 requests). Drafters that propose
        the same nodes (two SSMs, both right on the easy tokens) each add little of their own
        and would stop together though either alone pays: one leaves first (the one with the
        longest back-off, then the one whose leaving speeds the step most), and the others are
        judged without it."""
        proposed, kept_by = set(), []  # per cut tree: each kept node's drafters and value
        for tree, keep, order, value in zip(trees, kept, orders, values):
            if order is None:  # kept whole by rule: says nothing about the drafter's worth
                continue
            keep = set(keep)
            sources: dict[int, set[int]] = {}
            for child, source in zip(tree.prop_child, tree.prop_source):
                proposed.add(source)
                if child in keep:
                    sources.setdefault(child, set()).add(source)
            kept_by.append([(by, value[child]) for child, by in sources.items()])
        used = set().union(*(by for nodes in kept_by for by, _ in nodes))
        if tokens is None:
            used = set()
        # A drafter back from a stop drafted with catching up: its time says little, so it is
        # kept on trial (one more step decides), and the others are judged as if it had not
        # drafted (its nodes must not push out one that was paying before it came back).
        on_trial = used & self._resumed.keys()
        used -= on_trial
        if draft_s is not None and used:
            batch, gone = len(trees), set(on_trial)

            def step_without(leaving: set[int]) -> tuple[float, float]:
                """Expected tokens and seconds of the step had `leaving` not drafted."""
                lost, width = 0.0, floor
                for nodes in kept_by:
                    stay = [v for by, v in nodes if not by <= leaving]
                    lost += sum(v for _, v in nodes) - sum(stay)
                    width = max(width, 1 + len(stay))
                seconds = self.rest + self.drafting * batch + self._at_most(batch, width)
                return tokens - lost, seconds - sum(draft_s[i] for i in leaving)

            rate = lambda step: step[0] / max(step[1], 1e-9)  # noqa: E731
            while used:
                now = rate(step_without(gone))
                faster = {i: rate(step_without(gone | {i})) - now for i in used}
                short = [i for i in used if faster[i] > 0]
                if not short:
                    break
                # The one with the longest back-off (stopped more often lately) leaves first:
                # two drafters about as good would otherwise take turns, each paying a catch-up.
                worst = max(short, key=lambda i: (self._explore.get(i, EXPLORE[0]), faster[i]))
                gone.add(worst)
                used.discard(worst)
        if draft_s is not None:
            for i in proposed - self._resumed.keys():  # a retry's time includes catching up
                per = draft_s[i] / len(trees)
                old = self.draft_each.get(i)
                self.draft_each[i] = _timing_average(old, per)
            for i in proposed & self._resumed.keys():  # what catching up cost, per token fed
                backlog, each = self._resumed[i], self.draft_each.get(i)
                if backlog > 0 and each is not None:
                    per = max(0.0, draft_s[i] - each * len(trees)) / backlog
                    self.catch_up_s[i] = _timing_average(self.catch_up_s.get(i), per)
        for i in proposed:
            if i in used:
                self._idle[i], self._explore[i] = 0, EXPLORE[0]
            else:
                self._idle[i] = PATIENCE - 1 if i in on_trial else self._idle.get(i, 0) + 1

    def drafts(self, drafters: int, batch: int = 1,
               backlog: list[int] | None = None) -> frozenset[int]:  # fmt: skip
        """Which of the `drafters` (ids 0..drafters-1) should draft this step's `batch` trees
        that may be cut: those the cut kept a node of lately, and a stopped one whose time to
        try again has come, if trees as large as lately could pay at this batch size (trying
        costs a forward as wide as the tree for every request) and earn back its catch-up.
        `backlog`: per drafter, the tokens it would feed before drafting (a stopped SSM's
        catch-up: what it skipped, prompts included; none for prompt lookup)."""
        run = set()
        self._resumed = {}
        for i in range(drafters):
            if self._idle.get(i, 0) >= PATIENCE:
                self._skipped[i] = self._skipped.get(i, 0) + 1
                shrank = batch < self._refused.get(i, 0)  # since its trees last could not pay
                if not shrank and self._skipped[i] < self._explore.get(i, EXPLORE[0]):
                    continue
                self._explore[i] = min(2 * self._explore.get(i, EXPLORE[0]), EXPLORE[1])
                waiting = backlog[i] if backlog else 0
                if not self._could_pay(i, batch, waiting):  # refused: backs off like a failure
                    self._refused[i], self._skipped[i] = batch, 0
                    continue
                self._refused.pop(i, None)
                self._resumed[i] = waiting
            self._skipped[i] = 0
            run.add(i)
        return frozenset(run)

    def stopped(self) -> set[int]:
        """The drafters that have stopped drafting (see `drafts`): an SSM among them need not
        feed new prompts (it catches up when it drafts again)."""
        return {i for i, idle in self._idle.items() if idle >= PATIENCE}

    def _could_pay(self, drafter: int, batch: int, backlog: int = 0) -> bool:
        """Whether `drafter`'s nodes in a tree like its last one would beat plain decoding for
        `batch` requests, by the learned rates and costs (untimed widths priced
        optimistically), by enough to earn back its catch-up (`backlog` tokens to feed first, at
        what a token cost in its last catch-ups) within the steps it would otherwise wait
        before trying again: a feature head stopped at 16 requests would catch up on all their
        prompts, ~1 s here, to draft one step that cannot pay."""
        tree = self._last_tree.get(drafter)
        if tree is None or self.estimate(batch, 2) <= 0:
            return True
        value = self.values(tree, confident=False)
        mine = {child for child, s in zip(tree.prop_child, tree.prop_source) if s == drafter}
        curve = list(accumulate(sorted((value[n] for n in mine), reverse=True)))
        spent = self.rest + self.draft_each.get(drafter, 0.0) * batch
        plain_step = self.rest + self._at_most(batch, 1)
        catch_up = backlog * self.catch_up_s.get(drafter, 0.0)
        horizon = self._explore.get(drafter, EXPLORE[0])
        for width in range(2, len(curve) + 2):
            seconds = spent + self.estimate(batch, width)
            # What plain steps would take for this step's tokens, less what it takes.
            saved = (1 + curve[width - 2]) * plain_step - seconds
            if saved > 0 and catch_up <= horizon * saved:
                return True
        return False

    def depth(self, drafter: int, widths: tuple[int, ...], batch: int,
              beam: int | None = None) -> int:  # fmt: skip
        """How many levels of its tree (widths per level; `beam`: only that many of a level's
        nodes, its best, get children) `drafter` should draft this step for `batch` requests:
        the depth of the node count k that maximises expected tokens per second, k nodes taken
        best first (level by level: values only fall with depth), at least 1 (whether to draft
        at all is `drafts`'). Untried depths lean on the depth above (`rate`), untried widths
        on the timed ones (`estimate`); trees grow from one level as far as the timings show
        that rows are cheap."""
        level_s = self.level_s.get(drafter, 0.0) * batch  # a level's forward, for the batch
        nodes, level = [], [1.0]  # (value, depth) of every node; the values of the last level
        for d, width in enumerate(widths, start=1):
            rates = [self.rate(drafter, d, r) for r in range(width)]
            if beam is not None:
                level = sorted(level, reverse=True)[:beam]
            level = [v * r for v in level for r in rates]
            nodes += [(v, d) for v in level]
        nodes.sort(key=lambda n: (-n[0], n[1]))  # a child is worth at most its parent
        if self.estimate(batch, 1) <= 0:
            return 1  # nothing timed yet: one level, then grow as the timings allow
        best, best_score, gain, deepest = len(widths), -1.0, 0.0, 0
        for k, (value, d) in enumerate(nodes, start=1):
            gain, deepest = gain + value, max(deepest, d)
            seconds = self.rest + (deepest + 1) * level_s + self.estimate(batch, 1 + k)
            if (1 + gain) / seconds > best_score:
                best, best_score = deepest, (1 + gain) / seconds
        return best

    def time_levels(self, drafter: int, levels: int, seconds: float, batch: int) -> None:
        """Record that `drafter` drafted `levels` levels for `batch` requests in `seconds` (a
        draft runs one forward more: the tokens accepted since the last one, under the root)."""
        if levels > 0:
            per = seconds / ((levels + 1) * batch)
            old = self.level_s.get(drafter)
            self.level_s[drafter] = _timing_average(old, per)

    def estimate(self, batch: int, width: int) -> float:
        """The target forward's time for `batch` trees padded to `width`, priced by its rows
        (batch x width: the linear layers' work), so timings carry over between batch sizes as
        requests join and leave: measured at that row count; between two measured counts, on
        the line through them; past the largest, on the line from it back to the largest count
        at most half as large, or else the smallest (two close counts differ mostly by noise: a
        line through them can come out flat and price any tree like a plain step), no lower
        than flat; else a lower bound (a forward costs at least what one of fewer rows
        costs, and, per row, at least what one of more rows costs per row). Once a count has
        run, it is priced by what it cost."""
        rows = batch * width
        if rows in self.cost:
            return self.cost[rows]
        timed = self._timed_rows()
        split = bisect.bisect(timed, rows)  # timed[:split] below rows, the rest above
        if 0 < split < len(timed):
            lo, hi = timed[split - 1], timed[split]
            return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (rows - lo) / (hi - lo)
        if split >= 2:
            hi = timed[split - 1]
            # The largest count at most hi / 2, else the smallest.
            lo = timed[max(0, bisect.bisect(timed, hi // 2) - 1)]
            slope = max(0.0, (self.cost[hi] - self.cost[lo]) / (hi - lo))
            return self.cost[hi] + slope * (rows - hi)
        bounds = [self.cost[r] for r in timed[:split]]
        bounds += [self.cost[r] * rows / r for r in timed[split:]]
        return max(bounds, default=0.0)

    def _timed_rows(self) -> list[int]:
        """The timed row counts in order (estimate runs ~100 times a step: sorted once per new
        count; counts are never removed, and the dict is held so a new one is noticed)."""
        cost, count, timed = self._sorted_rows
        if cost is not self.cost or count != len(self.cost):
            timed = sorted(self.cost)
            self._sorted_rows = (self.cost, len(self.cost), timed)
        return timed

    def observe(self, trees: list[TokenTree], paths: list[list[int]],
                next_tokens: list[int] | None = None) -> None:  # fmt: skip
        """Learn from a verification: every node whose parent was accepted was tested. `trees`
        may be the trees as drafted, before the cut (paths in their node ids), with the token
        the target took after each path (`next_tokens`): a node the cut dropped under the path's
        end counts as accepted if it is that token, as it would have been. So the rates are
        learned from every drafted node, not only the ones the cut kept (those are the likelier
        ones: their rates alone would rise, and trees be drafted deeper than pays)."""
        self._rates.clear()
        for key in self.tested:
            self.tested[key] *= DECAY
            self.accepted[key] *= DECAY
        for b, (tree, path) in enumerate(zip(trees, paths)):
            on_path = set(path)
            # The node the target's next token would have been, had the tree held it.
            after = -1 if next_tokens is None else tree.children[path[-1]].get(next_tokens[b], -1)
            props = zip(tree.prop_child, tree.prop_source, _kinds(tree), tree.prop_conf)
            for child, source, kind, conf in set(props):
                if tree.parents[child] in on_path:
                    hit = child in on_path or child == after
                    # By depth and rank: what `depth` plans and drafters are judged with.
                    keys = [(source, tree.depths[child], *kind)]
                    if conf >= 0:
                        keys.append((source, "conf", _conf_bin(conf)))
                    for key in keys:
                        self.tested[key] = self.tested.get(key, 0.0) + 1
                        self.accepted[key] = self.accepted.get(key, 0.0) + hit

    def time_step(self, batch: int, width: int, target_s: float, rest_s: float,
                  draft_s: float | None = None, warm: bool | None = None) -> None:  # fmt: skip
        """Record a step's timings: its target forward, the rest (verification, commit), and
        its drafting (None: it drafted nothing). A shape's first forward records its graph, so
        it is not counted, nor the drafting that step (a fresh drafter's first forwards record
        theirs: ten times a step's drafting, which would price a drafter out from the start).
        `warm`: whether the forward ran as its shape will again (the runner knows: True for a
        forward too wide for a graph, False for one that recorded); None: judged by the shape
        being seen before. A fresh engine at 16 requests verifies whole trees of 300-460 rows
        (~1.4 s each here) until a forward is priced: each new batch size's first was skipped,
        though forwards that wide run eagerly and are priced by their first run."""
        self.rest = _timing_average(self.rest or None, rest_s)
        first = (batch, width) not in self._seen
        self._seen.add((batch, width))
        if draft_s is not None and not first:
            per_request = draft_s / batch
            self.drafting = _timing_average(self.drafting or None, per_request)
        priced = (not first) if warm is None else warm
        if not priced:
            return
        rows = batch * width
        self.cost[rows] = _timing_average(self.cost.get(rows), target_s)
        self._lean_stale_prices(rows)

    def _lean_stale_prices(self, timed: int) -> None:
        """Every row count but the one just `timed` leans towards the most a smaller count costs,
        if the next smaller count has at least half as many rows (see STALE)."""
        floor, below = 0.0, None
        for r in sorted(self.cost):
            if r != timed and below is not None and r <= 2 * below and self.cost[r] > floor:
                self.cost[r] = floor + STALE * (self.cost[r] - floor)
            floor, below = max(floor, self.cost[r]), r


def _conf_bin(conf: float) -> int:
    return min(int(conf * CONF_BINS), CONF_BINS - 1)


def _kinds(tree: TokenTree) -> list[tuple[int, bool]]:
    """Per proposal, its rank among its drafter's proposals under the same parent (drafters
    propose their children best first), and whether another drafter proposed a child there
    that this one did not. Worked out once per tree as it stands (proposals are only ever
    added): a step prices its trees twice and learns from them once."""
    proposals = len(tree.prop_child)
    known = _KINDS.get(tree)
    if known is None or known[0] != proposals:
        known = _KINDS[tree] = (proposals, _work_out_kinds(tree))
    return known[1]


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tree -> (proposals, kinds)


def _work_out_kinds(tree: TokenTree) -> list[tuple[int, bool]]:
    seen: dict[tuple[int, int], int] = {}
    ranks = []
    by_parent: dict[int, dict[int, set[int]]] = {}  # parent -> drafter -> its children there
    for parent, child, source in zip(tree.prop_parent, tree.prop_child, tree.prop_source):
        ranks.append(seen.get((parent, source), 0))
        seen[(parent, source)] = ranks[-1] + 1
        by_parent.setdefault(parent, {}).setdefault(source, set()).add(child)
    return [
        (rank, any(not kids <= by_parent[parent][source]
                   for other, kids in by_parent[parent].items() if other != source))
        for rank, parent, source in zip(ranks, tree.prop_parent, tree.prop_source)
    ]  # fmt: skip


def must_draft(params: SamplingParams) -> bool:
    """A seeded sampling request is drafted by every drafter at every step: its seed must
    reproduce its output, so its trees must not depend on timings."""
    return params.seed is not None and not params.greedy


def _must_stay_whole(tree: TokenTree, params: SamplingParams) -> bool:
    """A tree with a sampled child (dropping some of its i.i.d. draws depending on what they
    drew would bias verification), or a seeded sampling request's (its seed must reproduce its
    output, so its trees must not depend on timings)."""
    return any(q >= 0 for q in tree.prop_q) or must_draft(params)
