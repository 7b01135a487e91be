"""One simulated worker: continuous batching over a KV budget, speculative steps, draft residency.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from nightjar.messages import Residency, StepStats
from planner_svc.simulator.acceptance_process import AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface
from planner_svc.simulator.policy_calls import PolicyCalls

REQ, REM, TOTAL, LAG, RESV = range(5)  # rows of SimWorker.seq (REM and LAG relative: see above)
NO_FLOOR = 1 << 62  # rem_floor with no live sequence


def step_stats(**values: object) -> StepStats:
    """The StepStats of one simulated step (a msgspec Struct: building one is cheap)."""
    return StepStats(**values)


class UniformBuffer:
    """Uniform draws fetched from the generator in large blocks (one call per ~64k draws)."""

    def __init__(self, rng: np.random.Generator, size: int = 1 << 16) -> None:
        self.rng, self.size = rng, size
        self._refill(size)

    def _refill(self, n: int) -> None:
        self.buf = self.rng.random(n)
        self.floats = self.buf.tolist()  # the same draws as Python floats: scalar reads stay cheap
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.size:
            self._refill(max(self.size, n))
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def pair(self) -> tuple[float, float]:
        """The next two draws, as ``take(2)`` would give them."""
        if self.pos + 2 > self.size:
            self._refill(max(self.size, 2))
        pos = self.pos
        self.pos = pos + 2
        return self.floats[pos], self.floats[pos + 1]


class SimWorker:
    """Per step (mirrors the engine): finish residency moves → admit queued requests that fit →
    γ = policy(batch) (0 while the draft is away) → draft catch-up if γ>0 and the draft is behind
    (tokens decoded at γ=0, and new prompts: the draft prefills what it has not seen) → draft γ
    passes + one target forward (decode rows, plus the new prompts' prefill rows) → accept (sampled)
    → emit → publish StepStats to the policy. verify_ms includes the prefill rows, as the engine's.
    Sequences live in one [5, max_batch] numpy array, so a step costs a handful of numpy calls and
    finishing sequences is one compaction. Every decode step emits at least one token per live
    sequence, so the rows hold values relative to two worker counters and a γ=0 step touches no
    array: true remaining = REM − ``ticks`` (decode steps so far; a speculative step also
    subtracts the accepted tokens), true draft lag = LAG + ``zero_run`` (γ=0 steps since the draft
    last caught up). The context is TOTAL − remaining (prompt + output is fixed per request). A lower
    bound on the remaining tokens (``rem_floor``) says when a sequence may have finished, so most
    steps skip the finish check.

    KV model: a request reserves prompt + output + γmax lookahead tokens on admission (no
    preemption). Offloading the draft grows the pool by ``draft_kv_share`` after ``offload_ms``;
    reloading waits until the used KV fits the smaller pool, shrinks it, and speculation resumes
    ``reload_ms`` later with the draft's KV rebuilt for every live token (catch-up).
    """

    def __init__(self, worker_id: str, *, surface: CostSurface, acceptance: AcceptanceProcess, max_batch: int,
                 kv_tokens: int, draft_kv_share: float, block_tokens: int, offload_ms: float, reload_ms: float,
                 gamma_max: int) -> None:
        self.id = worker_id
        self.surface, self.acceptance = surface, acceptance
        self.max_batch, self.gamma_max, self.block_tokens = max_batch, gamma_max, block_tokens
        self.small_pool = kv_tokens
        self.big_pool = int(kv_tokens * (1.0 + draft_kv_share))
        self.offload_ms, self.reload_ms = offload_ms, reload_ms
        self.pool = kv_tokens
        self.clock = 0.0
        self.speed = 1.0  # the machine's drift now (SimConfig.drift): step times × this
        self.n = 0  # live sequences
        self.seq = np.zeros((5, max_batch), dtype=np.int64)  # rows REQ, REM, TOTAL, LAG, RESV
        self.rem, self.lag_row = self.seq[REM], self.seq[LAG]  # [max_batch] views: cheaper to slice
        self.ticks = 0  # decode steps so far: true remaining = REM - ticks
        self.zero_run = 0  # γ=0 steps since the draft caught up: true lag = LAG + zero_run
        self.lag_zero = True  # every live sequence's true draft lag is 0
        self.rem_floor = NO_FLOOR  # <= every live sequence's true remaining tokens
        self.reserved = 0
        self.residency = Residency.RESIDENT  # resident | offloading | offloaded | reloading
        self.move_done_ms = 0.0
        self.reload_wanted = False  # a reload waits until the used KV fits the smaller pool
        self.last_gamma = -1
        self.switches = 0
        self.offloads = 0
        self.reloads = 0
        self.step_no = 0
        self.finished: list[int] = []  # requests finished since the caller last cleared it

    @property
    def draft_ready(self) -> bool:
        return self.residency == Residency.RESIDENT

    def remaining(self) -> np.ndarray:
        """True remaining tokens of the live sequences, [n]."""
        return self.seq[REM, : self.n] - self.ticks

    def _residency_tick(self, now: float) -> None:
        if self.residency == "offloading" and now >= self.move_done_ms:
            self.residency, self.pool = Residency.OFFLOADED, self.big_pool
        elif self.reload_wanted and self.residency == Residency.OFFLOADED and self.reserved <= self.small_pool:
            self.residency, self.pool, self.move_done_ms = "reloading", self.small_pool, now + self.reload_ms
            self.reload_wanted = False
        elif self.residency == "reloading" and now >= self.move_done_ms:
            self.residency = Residency.RESIDENT
            # The draft's KV was dropped: its lag is the whole context, TOTAL - remaining.
            n = self.n
            self.seq[LAG, :n] = self.seq[TOTAL, :n] - self.remaining() - self.zero_run
            self.lag_zero = n == 0

    def direct(self, residency: str, now: float) -> None:
        if residency == Residency.OFFLOADED and self.residency == Residency.RESIDENT:
            self.residency, self.move_done_ms = "offloading", now + self.offload_ms
            self.offloads += 1
        elif residency == Residency.RESIDENT and self.residency == Residency.OFFLOADED and not self.reload_wanted:
            self.reload_wanted = True
            self.reloads += 1

    def step(self, queue: deque, prompt: list[int], output: list[int], policy: PolicyCalls,
             uniforms: UniformBuffer, noise: float, first_token_ms: np.ndarray, done_ms: np.ndarray) -> bool:
        """Run one step at ``self.clock``; False when there is nothing to do (caller advances time)."""
        now = self.clock
        if self.residency != Residency.RESIDENT or self.reload_wanted:
            self._residency_tick(now)
        n = batch = self.n  # decode batch: sequences already past their prefill
        surface = self.surface
        # admit: FCFS while there is a batch slot and KV room (not while a reload waits to fit)
        new = []
        prefill_tokens = 0
        if queue and not self.reload_wanted:
            slots = self.max_batch - n
            while queue and len(new) < slots:
                r = queue[0]
                need = prompt[r] + output[r] + self.gamma_max
                if self.reserved + need > self.pool:
                    break
                queue.popleft()
                self.reserved += need
                new.append(r)
                prefill_tokens += prompt[r]
        if n == 0 and not new:
            return False
        gamma = 0
        draft_ms = verify_ms = catchup_ms = 0.0
        catchup_tokens = emitted = 0
        accepted: tuple[int, ...] = ()
        seq = self.seq
        if n:
            if self.residency == Residency.RESIDENT:
                gamma = min(policy.gamma(n, self.id), self.gamma_max)
            draft_ms = surface.draft_ms[n][gamma]
            verify_ms = surface.verify_ms[n][gamma]
            if noise:
                f0, f1 = uniforms.pair()
                draft_ms *= 1.0 + noise * (2.0 * f0 - 1.0)
                verify_ms *= 1.0 + noise * (2.0 * f1 - 1.0)
            if gamma:
                if not self.lag_zero:  # the draft catches up on what it has not seen
                    catchup_tokens = int(self.lag_row[:n].sum()) + n * self.zero_run
                    if catchup_tokens:
                        catchup_ms = surface.catchup_ms_fixed + surface.catchup_ms_per_token * catchup_tokens
                    self.lag_row[:n] = 0
                    self.zero_run = 0
                    self.lag_zero = True
                got = self.acceptance.cdf[gamma].searchsorted(uniforms.take(n), side="right")  # [n] in 0..γ
                if policy.learns:  # what StepStats reports; a policy that learns nothing never reads it
                    counts = np.bincount(got, minlength=gamma + 1).tolist()  # [γ+1]
                    left, acc = n, []
                    for c in counts[:-1]:  # sequences accepting position i: those with got > i
                        left -= c
                        acc.append(left)
                    accepted = tuple(acc)
                    if self.rem_floor > gamma:
                        emitted = n + sum(acc)  # no sequence overshoots its end: Σ got = Σ accepted
                    else:
                        emitted = int(np.minimum(got + 1, self.remaining()).sum())
                self.rem[:n] -= got  # the bonus token of every sequence is the tick below
                self.rem_floor -= gamma + 1
            else:  # every live sequence has >= 1 token left: each emits one, the draft falls behind
                emitted = n
                self.zero_run += 1
                self.rem_floor -= 1
                self.lag_zero = False
            self.ticks += 1
            if gamma != self.last_gamma:
                self.switches += self.last_gamma >= 0
                self.last_gamma = gamma
        # New prompts ride in the same target forward as the decode rows (as in the engine), so
        # their time is part of verify_ms; the draft sees them at its next speculative step.
        if prefill_tokens:
            verify_ms += surface.prefill_ms_per_token * prefill_tokens
        if self.speed != 1.0:
            draft_ms, verify_ms, catchup_ms = draft_ms * self.speed, verify_ms * self.speed, catchup_ms * self.speed
        step_ms = draft_ms + verify_ms + catchup_ms
        end = now + step_ms
        self.clock = end
        if n and self.rem_floor <= 0:  # some sequence may have finished
            rem = self.rem[:n]
            if int(rem.min()) <= self.ticks:
                finished = rem <= self.ticks
                done = seq[:, :n][:, finished]  # [5, f]
                done_ms[done[REQ]] = end
                self.finished.extend(done[REQ].tolist())
                self.reserved -= int(done[RESV].sum())
                keep = seq[:, :n][:, ~finished]  # [5, k]
                n = self.n = keep.shape[1]
                seq[:, :n] = keep
            self.rem_floor = int(self.rem[:n].min()) - self.ticks if n else NO_FLOOR
        for r in new:
            first_token_ms[r] = end
            left = output[r] - 1
            need = prompt[r] + output[r] + self.gamma_max
            if left <= 0:
                done_ms[r] = end
                self.finished.append(r)
                self.reserved -= need
                continue
            # draft lag: the whole prompt (the draft has not seen it)
            seq[:, n] = (r, left + self.ticks, prompt[r] + output[r], prompt[r] + 1 - self.zero_run, need)
            n += 1
            self.lag_zero = False
            self.rem_floor = min(self.rem_floor, left)
        self.n = n
        if batch:  # a prefill-only step carries no decode measurement
            self.step_no += 1
            if policy.learns:
                policy.update(step_stats(
                    worker_id=self.id, step=self.step_no, unix_ms=int(end), batch_size=batch, gamma=gamma,
                    draft_ms=draft_ms, verify_ms=verify_ms, step_ms=step_ms, accepted_per_position=accepted,
                    emitted_tokens=emitted, prefill_tokens=prefill_tokens, catchup_tokens=catchup_tokens,
                    catchup_ms=catchup_ms, kv_blocks_used=-(-self.reserved // self.block_tokens),
                    kv_blocks_free=max(self.pool - self.reserved, 0) // self.block_tokens, waiting=len(queue),
                    draft_residency=self.residency))
            if policy.directs:
                self.direct(policy.residency_for(self.id), end)
        return True
