"""The KV caches of the target and of every SSM, handed out per sequence.

The target's cache is a pool of blocks of `block_len` positions: a sequence holds as many as its
tokens need, taken as it grows (`reserve`) and all given back the moment it finishes, is aborted
or is preempted, so the budget goes to what requests actually hold, not to their longest
possible length. The forwards address it through a block table per sequence (ops.kv_locations);
entries past a sequence's blocks point at block 0, a scratch block that only the padding of a
batch writes and nothing reads.

The SSMs' caches stay one row per running sequence (they are small): a sequence gets a row in
each on admission (`allocate`). The caches are allocated on first use and kept (the graphs
recorded over them replay from then on) until `release`.
"""

from __future__ import annotations

import torch

from specinfer.engine.sequence import Sequence

BLOCK_LEN = 16  # positions per block of the target's cache


class KVManager:
    def __init__(self, runner, drafter, rows: int, row_len: int, num_blocks: int,
                 block_len: int, device: torch.device):  # fmt: skip
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

    @property
    def num_free(self) -> int:
        return self.rows - len(self.owners)

    @property
    def capacity(self) -> int:
        """The most positions one sequence's block table addresses."""
        return self.blocks_per_seq * self.block_len

    def allocate(self, seq: Sequence, tokens: int) -> bool:
        """Give `seq` a row in every SSM cache and target blocks for `tokens` positions; False
        (and nothing taken) when either is short."""
        if self.kv is None:
            self._make_caches()
        if not self.free_rows or self._blocks_for(seq, tokens) > len(self.free_blocks):
            return False
        seq.row = self.free_rows.pop()
        self.owners[seq.row] = seq
        self.reserve(seq, tokens)
        if self.drafter:
            self.drafter.admit(seq.row)  # its SSM state starts empty
        return True

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Make `seq`'s blocks hold `tokens` positions; False (nothing taken) when the pool
        is short."""
        need = self._blocks_for(seq, tokens)
        if need > len(self.free_blocks):
            return False
        seq.blocks += [self.free_blocks.pop() for _ in range(need)]
        return True

    def free(self, seq: Sequence) -> None:
        if seq.row >= 0 and self.owners.get(seq.row) is seq:
            del self.owners[seq.row]
            self.free_rows.append(seq.row)
            self.free_blocks += reversed(seq.blocks)
        seq.row, seq.blocks = -1, []

    def table(self, seqs: list[Sequence]) -> torch.Tensor:
        """The sequences' block tables [B, blocks per sequence] (rows [B] when a block is a
        whole row), scratch block 0 past their blocks."""
        if self.blocks_per_seq == 1:
            return torch.tensor([s.blocks[0] for s in seqs], device=self.device)
        width = self.blocks_per_seq
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs],
                            device=self.device)  # fmt: skip

    def used_tokens(self) -> int:
        """Positions the running sequences' blocks hold."""
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
        self.free_rows, self.free_blocks = [], []
        for ssm in self.drafter.ssms if self.drafter else []:
            if hasattr(ssm, "release"):
                ssm.release()

    def _make_caches(self) -> None:
        scratch = 1 if self.blocks_per_seq > 1 else 0
        self.kv = self.runner.new_cache(self.num_blocks + scratch, self.block_len)
        if self.drafter:
            self.drafter.reset(self.rows, self.row_len)
        self.free_rows = list(range(self.rows - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks + scratch - 1, scratch - 1, -1))

    def _blocks_for(self, seq: Sequence, tokens: int) -> int:
        return max(0, -(-min(tokens, self.capacity) // self.block_len) - len(seq.blocks))
