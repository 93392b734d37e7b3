"""The KV caches of the target and of every SSM, handed out per sequence.

The target's cache is a pool of blocks of `block_len` positions: a sequence holds as many as its
tokens need, taken as it grows (`reserve`) and all given back the moment it finishes, is aborted
or is preempted, so the budget goes to what requests actually hold, not to their longest
possible length. The forwards address it through a block table per sequence (ops.kv_locations);
entries past a sequence's blocks point at block 0, a scratch block that only the padding of a
batch writes and nothing reads. With prefix caching (prefix_cache.py), full blocks stay cached
after their sequence lets them go, and a sequence admitted with the same first tokens takes them
(its prefill starts after them); cached blocks no one holds are taken back when the pool is short.

The SSMs' caches stay one row per running sequence (they are small): a sequence gets a row in
each on admission (`allocate`). The caches are allocated on first use and kept (the graphs
recorded over them replay from then on) until `release`.
"""

from __future__ import annotations

import torch

from specinfer.engine.prefix_cache import ROOT, PrefixCache, digest
from specinfer.engine.sequence import Sequence

BLOCK_LEN = 16  # positions per block of the target's cache


class KVManager:
    def __init__(self, runner, drafter, rows: int, row_len: int, num_blocks: int,
                 block_len: int, device: torch.device, prefix_caching: bool = False):  # fmt: skip
        """runner: the target's ModelRunner (it holds the cache); rows: sequences at once (the
        SSMs' rows); row_len: the most positions a sequence may use; num_blocks x block_len:
        the target's positions in all."""
        self.runner, self.drafter = runner, drafter
        self.rows, self.row_len = rows, row_len
        self.num_blocks, self.block_len, self.device = num_blocks, block_len, device
        self.blocks_per_seq = -(-row_len // block_len)
        self.kv = None
        self.free_rows: list[int] = []
        self.free_blocks: list[int] = []
        self.owners: dict[int, Sequence] = {}  # row -> the sequence in it
        self.prefix = PrefixCache() if prefix_caching else None

    @property
    def num_free(self) -> int:
        return self.rows - len(self.owners)

    @property
    def capacity(self) -> int:
        """The most positions one sequence's block table addresses."""
        return self.blocks_per_seq * self.block_len

    def allocate(self, seq: Sequence, tokens: int) -> bool:
        """Give `seq` a row in every SSM cache and target blocks for `tokens` positions, the
        cached blocks of its first tokens among them (seq.num_computed: the tokens they hold);
        False (and nothing taken) when either is short."""
        if self.kv is None:
            self._make_caches()
        if not self.free_rows:
            return False
        skippable = self._skippable(seq)
        hit = self.prefix.match(skippable) if skippable else []
        taken_idle = sum(b in self.prefix.idle for b in hit) if hit else 0
        if self._blocks_for(seq, tokens) - len(hit) > self._num_free_blocks() - taken_idle:
            return False
        seq.row = self.free_rows.pop()
        self.owners[seq.row] = seq
        for block in hit:
            self.prefix.hold(block)
        seq.blocks, seq.registered_blocks = hit, len(hit)
        seq.num_computed = len(hit) * self.block_len
        self.reserve(seq, tokens)
        if self.drafter:
            self.drafter.admit(seq.row)  # its SSM state starts empty
        return True

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Make `seq`'s blocks hold `tokens` positions; False (nothing taken) when the pool
        is short."""
        need = self._blocks_for(seq, tokens)
        if need > self._num_free_blocks():
            return False
        for _ in range(need):
            block = self.free_blocks.pop() if self.free_blocks else self.prefix.evict()
            if self.prefix:
                self.prefix.hold(block)
            seq.blocks.append(block)
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """With prefix caching, cache `seq`'s blocks whose every position holds its token's
        final K/V (seq.num_cached: nothing writes there again)."""
        full = min(seq.num_cached // self.block_len, len(seq.blocks))
        if self.prefix is None or full <= seq.registered_blocks:
            return
        digests = self._digests(seq, full)
        for i in range(seq.registered_blocks, full):
            self.prefix.register(seq.blocks[i], digests[i])
        seq.registered_blocks = full

    def prefilling(self, seqs: list[Sequence]) -> set[bytes]:
        """The digests of the blocks these sequences' prefills will fill and have not yet
        cached (with prefix caching; empty without)."""
        if self.prefix is None:
            return set()
        out = set()
        for seq in seqs:
            full = seq.prefill_len // self.block_len
            out.update(self._digests(seq, full)[seq.registered_blocks :])
        return out

    def awaits(self, seq: Sequence, prefilling: set[bytes]) -> bool:
        """Whether the first block of `seq` the cache lacks is one being prefilled (by a
        sequence admitted before it): admitted a step later, it finds that block cached."""
        skippable = self._skippable(seq)
        hit = len(self.prefix.match(skippable)) if skippable else 0
        return hit < len(skippable) and skippable[hit] in prefilling

    def forget_prefixes(self) -> None:
        """Forget every cached prefix (the blocks sequences hold stay theirs)."""
        if self.prefix:
            self.free_blocks += self.prefix.forget()

    def free(self, seq: Sequence) -> None:
        if seq.row >= 0 and self.owners.get(seq.row) is seq:
            self.cache_computed(seq)  # what it filled since the last step
            del self.owners[seq.row]
            self.free_rows.append(seq.row)
            # The last blocks first: with prefix caching, they are the first taken back.
            for block in reversed(seq.blocks):
                if self.prefix is None or self.prefix.release(block):
                    self.free_blocks.append(block)
        seq.row, seq.blocks, seq.registered_blocks = -1, [], 0

    def table(self, seqs: list[Sequence]) -> torch.Tensor:
        """The sequences' block tables [B, blocks per sequence] (rows [B] when a block is a
        whole row), scratch block 0 past their blocks."""
        if self.blocks_per_seq == 1:
            return torch.tensor([s.blocks[0] for s in seqs], device=self.device)
        width = self.blocks_per_seq
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs],
                            device=self.device)  # fmt: skip

    def used_tokens(self) -> int:
        """Positions the running sequences' blocks hold (a block they share counted once)."""
        if self.prefix:
            return self.block_len * len(self.prefix.holders)
        # list() copies in one go: monitoring reads this from another thread.
        return self.block_len * sum(len(s.blocks) for s in list(self.owners.values()))

    def release(self) -> None:
        """Free the caches (only when no sequence holds a row)."""
        if self.owners:
            raise RuntimeError(
                f"cannot release the KV caches: {len(self.owners)} requests hold rows"
            )
        self.runner.free_cache()
        self.kv = None
        self.forget_prefixes()
        self.free_rows, self.free_blocks = [], []
        for ssm in self.drafter.ssms if self.drafter else []:
            if hasattr(ssm, "release"):
                ssm.release()

    def _make_caches(self) -> None:
        scratch = 1 if self.blocks_per_seq > 1 else 0
        self.kv = self.runner.new_cache(self.num_blocks + scratch, self.block_len)
        if self.drafter:
            self.drafter.reset(self.rows, self.row_len)
            if self.prefix:
                self.drafter.keep_features_by_block(self.num_blocks + scratch, self.block_len)
        self.free_rows = list(range(self.rows - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks + scratch - 1, scratch - 1, -1))

    def _blocks_for(self, seq: Sequence, tokens: int) -> int:
        return max(0, -(-min(tokens, self.capacity) // self.block_len) - len(seq.blocks))

    def _num_free_blocks(self) -> int:
        return len(self.free_blocks) + (len(self.prefix.idle) if self.prefix else 0)

    def _skippable(self, seq: Sequence) -> list[bytes]:
        """The digests of the blocks `seq`'s prefill may skip where the cache holds them (none
        without prefix caching). At least one token is left to prefill (its logits come from
        that forward), and a prompt that is scored (prompt logprobs) is prefilled whole."""
        if self.prefix is None or seq.scores_prompt or self.blocks_per_seq == 1:
            return []
        return self._digests(seq, (seq.prefill_len - 1) // self.block_len)

    def _digests(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The digests of `seq`'s first `blocks` blocks of tokens (kept on the sequence: its
        tokens only ever grow)."""
        n = self.block_len
        for i in range(len(seq.digests), blocks):
            parent = seq.digests[-1] if seq.digests else ROOT
            seq.digests.append(digest(parent, seq.token_slice(i * n, (i + 1) * n)))
        return seq.digests[:blocks]
