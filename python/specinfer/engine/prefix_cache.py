"""Prefix caching: full blocks of the target's KV cache outlive their sequences, and a request
whose tokens begin the same way takes them instead of prefilling those tokens again (a shared
system prompt, the earlier turns of a chat, a preempted request coming back).

A block is known by a digest of every token up to its end (a chain: its own tokens and its
parent's digest), since its K/V depend on all of them. It is registered once its positions are
all computed and committed; nothing writes there again (a sequence only writes past what it has
committed). Blocks are counted by the sequences holding them; one no sequence holds stays
cached, idle, until the pool needs it: the least recently released goes first, and a
sequence's last blocks are released before its first, so the tail of a prefix goes before
its head.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT = b""  # the digest before a sequence's first block


def digest(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self):
        self.block_of: dict[bytes, int] = {}  # digest -> the block holding those tokens' K/V
        self.digest_of: dict[int, bytes] = {}  # the inverse
        self.holders: dict[int, int] = {}  # held block -> sequences holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first

    def match(self, digests: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `digests` from the first."""
        blocks = []
        for d in digests:
            block = self.block_of.get(d)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def hold(self, block: int) -> None:
        self.idle.pop(block, None)
        self.holders[block] = self.holders.get(block, 0) + 1

    def release(self, block: int) -> bool:
        """One sequence lets `block` go; True when no one holds it and it is not cached (free)."""
        self.holders[block] -= 1
        if self.holders[block]:
            return False
        del self.holders[block]
        if block in self.digest_of:
            self.idle[block] = None
            return False
        return True

    def register(self, block: int, d: bytes) -> None:
        """`block` holds the tokens of digest `d`, unless another block already does."""
        if d not in self.block_of and block not in self.digest_of:
            self.block_of[d], self.digest_of[block] = block, d

    def evict(self) -> int | None:
        """The least recently released idle block, forgotten (None when there is none)."""
        if not self.idle:
            return None
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.digest_of.pop(block)]
        return block

    def forget(self) -> list[int]:
        """Forget every cached prefix; returns the idle blocks, now free."""
        free = list(self.idle)
        self.block_of.clear()
        self.digest_of.clear()
        self.idle.clear()
        return free
