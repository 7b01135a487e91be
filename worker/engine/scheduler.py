"""Scheduler: which sequences run this step and how many tokens each is fed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    gamma: int
    decode: list[Sequence] = field(default_factory=list)  # fed [last token] + γ proposals
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, chunk length)
    preempted: int = 0
    preempted_tokens: int = 0  # KV the preemptions freed: prefilled again when they come back

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Per step, in order:
    1. every running sequence past its prefill decodes: it is fed its last token plus γ proposals,
       so its target table must hold num_tokens + γ slots (γ lookahead slots) and, when γ > 0, its
       draft table num_tokens + γ - 1. When blocks run out the newest running sequence is
       preempted (KV freed, recomputed later) — possibly the one asking.
    2. partially prefilled sequences get the next chunk of the remaining token budget;
    3. waiting sequences are admitted first come first served while the token budget,
       ``max_running`` and the free blocks above the watermark allow. Admission allocates blocks
       for the whole prompt at once, so prefill chunks never wait for memory.
    """

    def __init__(self, target: BlockManager, draft: BlockManager | None, max_running: int,
                 max_batched_tokens: int) -> None:
        self.target, self.draft = target, draft
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def num_decoding(self) -> int:
        return sum(1 for s in self.running if not s.is_prefill)

    def schedule(self, gamma: int) -> ScheduledBatch:
        batch = ScheduledBatch(gamma=gamma)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.is_prefill:
                i += 1
                continue
            while not self._reserve(seq, gamma):
                victim = self.running[-1]
                batch.preempted_tokens += victim.num_computed
                self.preempt(victim)
                batch.preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.decode.append(seq)
                i += 1
        budget = self.max_batched_tokens - len(batch.decode) * (gamma + 1)
        for seq in self.running:
            if seq.is_prefill and budget > 0:
                chunk = min(seq.num_tokens - seq.num_computed, budget)
                batch.prefill.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.target.can_admit(seq.block_table, seq.num_tokens + 1):
                break
            self.waiting.popleft()
            ok = self.target.ensure(seq.block_table, seq.num_tokens)
            assert ok, "can_admit guaranteed the blocks"
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            batch.prefill.append((seq, chunk))
            budget -= chunk
        return batch

    def _reserve(self, seq: Sequence, gamma: int) -> bool:
        """Lookahead slots for γ proposals in both pools (all-or-nothing per pool)."""
        if not self.target.ensure(seq.block_table, seq.num_tokens + gamma):
            return False
        if gamma > 0 and self.draft is not None:
            if not self.draft.ensure(seq.draft_table, seq.num_tokens + gamma - 1):
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop its KV in both pools; it re-enters the queue first."""
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def free_blocks(self, seq: Sequence) -> None:
        self.target.free(seq.block_table)
        if self.draft is not None:
            self.draft.free(seq.draft_table)
        seq.draft_computed = 0

    def drop_draft_kv(self) -> None:
        """Every draft table back to its pool (the memory manager frees or reallocates it next);
        the next speculative step catches each sequence up from scratch (reported in StepStats)."""
        if self.draft is None:
            return
        for seq in [*self.running, *self.waiting]:
            self.draft.free(seq.draft_table)
            seq.draft_computed = 0

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = Status.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
