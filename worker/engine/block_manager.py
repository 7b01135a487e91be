"""BlockManager: the free list of one paged KV pool and the per-sequence block tables.

Tables are plain lists of block ids owned by each Sequence; the manager only hands blocks out,
takes them back and keeps the count. A watermark of free blocks is held back from admission
of new sequences so that running ones can still grow (no admit/preempt thrash).
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1 (raise kv_budget_bytes or lower block_size)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark = watermark
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def watermark_blocks(self) -> int:
        return max(1, int(self.watermark * self.num_blocks)) if self.num_blocks > 1 else 0

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_admit(self, table: list[int], num_tokens: int) -> bool:
        """Room for a new sequence's tokens while keeping the watermark free."""
        need = self.blocks_for(num_tokens) - len(table)
        return need <= self.num_free - self.watermark_blocks

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow ``table`` to hold ``num_tokens`` slots; False (table unchanged) if blocks run out."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.pop())
        return True

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Free the blocks past what ``num_tokens`` slots need (speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._free.append(table.pop())

    # ------------------------------------------------------------------ elastic pool

    def grow(self, new_num_blocks: int) -> None:
        """The pool tensor grew to ``new_num_blocks``: the new ids become free."""
        assert new_num_blocks >= self.num_blocks
        self._free[:0] = list(range(new_num_blocks - 1, self.num_blocks - 1, -1))
        self.num_blocks = new_num_blocks

    def plan_shrink(self, new_num_blocks: int, tables: list[list[int]]) -> dict[int, int] | None:
        """Moves {old id -> new id} that empty ids >= new_num_blocks, or None if live blocks
        would not fit. Applies nothing; ``apply_shrink`` does after the pool is copied."""
        used_high = sorted({b for t in tables for b in t if b >= new_num_blocks})
        free_low = sorted(b for b in self._free if b < new_num_blocks)
        if len(used_high) > len(free_low):
            return None
        return dict(zip(used_high, free_low))

    def apply_shrink(self, new_num_blocks: int, moves: dict[int, int], tables: list[list[int]]) -> None:
        for t in tables:
            t[:] = [moves.get(b, b) for b in t]
        taken = set(moves.values())
        self._free = [b for b in self._free if b < new_num_blocks and b not in taken]
        self._free.sort(reverse=True)
        self.num_blocks = new_num_blocks
