"""Paged KV-cache bookkeeping (pure Python: no torch).

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns the blocks in
its ``block_table`` (in position order); position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size`` (`slot_of`, `slot_mapping`).
Blocks are exclusively owned (no prefix sharing yet): a block is either free or in exactly one
block table. All of ``0 .. num_blocks - 1`` are usable; an engine that needs a scratch slot for
padded rows (CUDA-graph buckets) allocates one block more in its tensors than it tells us.
"""

from __future__ import annotations

from lorafn.runtime.sequence import Sequence


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat KV slot of ``position`` for a sequence with ``block_table``."""
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Flat KV slots of positions ``start .. start + num_tokens - 1``."""
    return [
        block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)
    ]


class BlockManager:
    """Free list of KV blocks; hands them to sequences and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Stack: lowest ids handed out first (deterministic, and keeps the used part of the cache compact).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, str] = {}  # block id -> seq_id, for double-allocation checks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Positions the whole cache holds: the longest sequence that can ever fit alone."""
        return self.num_blocks * self.block_size

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add to ``seq`` so that its table covers positions ``0 .. num_tokens - 1``."""
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``allocate(seq, num_tokens)`` would succeed now."""
        return self.num_blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Append blocks to ``seq.block_table`` until it covers ``num_tokens`` positions.

        Returns the blocks added (possibly none). Raises RuntimeError (and changes nothing) when
        there are not enough free blocks: callers ask `can_allocate` first.
        """
        needed = self.num_blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"cannot allocate {needed} blocks for sequence {seq.seq_id!r}: "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        added = [self._free.pop() for _ in range(needed)]
        for block in added:
            self._owner[block] = seq.seq_id
        seq.block_table.extend(added)
        return added

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list and empty its block table."""
        for block in reversed(seq.block_table):
            owner = self._owner.pop(block, None)
            if owner != seq.seq_id:
                raise RuntimeError(f"block {block} freed by sequence {seq.seq_id!r} but owned by {owner!r}")
            self._free.append(block)
        seq.block_table.clear()

    def resize(self, num_blocks: int) -> None:
        """Hand out ``0 .. num_blocks - 1`` from now on (`Engine.resize_kv`): a larger cache adds free
        blocks; a smaller one drops free blocks from the top. Raises ValueError (and changes nothing) when a
        block at or above ``num_blocks`` is in use."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        held = [b for b in self._owner if b >= num_blocks]
        if held:
            raise ValueError(
                f"num_blocks: {num_blocks} would drop {len(held)} blocks in use (the highest is {max(held)})"
            )
        kept = [b for b in self._free if b < num_blocks]
        self._free = sorted(kept + list(range(self.num_blocks, num_blocks)), reverse=True)
        self.num_blocks = num_blocks

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError when blocks leak or are shared. For tests and debugging."""
        seen: set[int] = set()
        for seq in seqs:
            for block in seq.block_table:
                if block in seen:
                    raise AssertionError(f"block {block} is in two block tables")
                if self._owner.get(block) != seq.seq_id:
                    raise AssertionError(f"block {block} of {seq.seq_id!r} is not recorded as its own")
                seen.add(block)
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is twice in the free list")
        if free & seen:
            raise AssertionError(f"blocks both free and in use: {sorted(free & seen)}")
        if len(free) + len(seen) != self.num_blocks:
            raise AssertionError(f"leak: {len(free)} free + {len(seen)} in use != {self.num_blocks} blocks")
