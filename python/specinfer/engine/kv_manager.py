"""The KV caches of the target and of every SSM: one row per running sequence.

A row holds one sequence whole (up to `row_len` tokens: the longest request allowed plus room
for a token tree), so a running sequence never runs out of cache and nothing is ever re-sized
or copied: rows are handed out on admission and back the moment a sequence finishes or is
aborted. The caches are allocated on first use and kept (the graphs recorded over them replay
from then on) until `release`.
"""

from __future__ import annotations

from torch import nn

from specinfer.engine.sequence import Sequence


class KVManager:
    def __init__(self, model: nn.Module, drafter, rows: int, row_len: int):
        self.model, self.drafter = model, drafter
        self.rows, self.row_len = rows, row_len
        self.kv = None
        self.free_rows: list[int] = []
        self.owners: dict[int, Sequence] = {}  # row -> the sequence in it

    @property
    def num_free(self) -> int:
        return self.rows - len(self.owners)

    def allocate(self, seq: Sequence) -> bool:
        """Give `seq` a row in every cache; False when none is free."""
        if self.kv is None:
            self.kv = self.model.make_kv_cache(self.rows, self.row_len)
            if self.drafter:
                self.drafter.reset(self.rows, self.row_len)
            self.free_rows = list(range(self.rows - 1, -1, -1))
        if not self.free_rows:
            return False
        seq.row = self.free_rows.pop()
        self.owners[seq.row] = seq
        if self.drafter:
            self.drafter.admit(seq.row)  # its SSM state starts empty
        return True

    def free(self, seq: Sequence) -> None:
        if seq.row >= 0 and self.owners.get(seq.row) is seq:
            del self.owners[seq.row]
            self.free_rows.append(seq.row)
        seq.row = -1

    def used_tokens(self) -> int:
        """Tokens the running sequences hold in the target's cache."""
        # list() copies in one go: monitoring reads this from another thread.
        return sum(s.num_computed + len(s.output_ids) for s in list(self.owners.values()))

    def release(self) -> None:
        """Free the caches (only when no sequence holds a row)."""
        if self.owners:
            raise RuntimeError(
                f"cannot release the KV caches: {len(self.owners)} requests hold rows"
            )
        self.kv = None
        self.free_rows = []
        for ssm in self.drafter.ssms if self.drafter else []:
            if hasattr(ssm, "release"):
                ssm.release()
