"""One simulated worker: continuous batching over a KV budget, speculative steps, draft residency.

Per step (mirrors the engine): finish residency moves → admit queued requests that fit →
γ = policy(batch) (0 while the draft is away) → draft catch-up if γ>0 and the draft is behind
(tokens decoded at γ=0, and new prompts: the draft prefills what it has not seen) → draft γ
passes + one target forward (decode rows, plus the new prompts' prefill rows) → accept (sampled)
→ emit → publish StepStats to the policy. verify_ms includes the prefill rows, as the engine's.
Sequences live in one [5, max_batch] numpy array (request, remaining, context, draft lag,
reserved), so a step costs a handful of numpy calls and finishing sequences is one compaction.

KV model: a request reserves prompt + output + γmax lookahead tokens on admission (no
preemption). Offloading the draft grows the pool by ``draft_kv_share`` after ``offload_ms``;
reloading waits until the used KV fits the smaller pool, shrinks it, and speculation resumes
``reload_ms`` later with the draft's KV rebuilt for every live token (catch-up).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from nightjar.messages import StepStats
from planner_svc.policies.base import OFFLOADED, RESIDENT, Context, GammaPolicy
from planner_svc.simulator.acceptance_process import AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface


REQ, REM, CTX, LAG, RESV = range(5)  # rows of SimWorker.seq


class UniformBuffer:
    """Uniform draws fetched from the generator in large blocks (one call per ~64k draws)."""

    def __init__(self, rng: np.random.Generator, size: int = 1 << 16) -> None:
        self.rng, self.size = rng, size
        self.buf = rng.random(size)
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.size:
            self.buf = self.rng.random(max(self.size, n))
            self.pos = 0
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out


class SimWorker:
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
        self.n = 0  # live sequences
        self.seq = np.zeros((5, max_batch), dtype=np.int64)  # rows REQ, REM, CTX, LAG, RESV
        self.reserved = 0
        self.residency = RESIDENT  # resident | offloading | offloaded | reloading
        self.move_done_ms = 0.0
        self.reload_wanted = False  # a reload waits until the used KV fits the smaller pool
        self.last_gamma = -1
        self.switches = 0
        self.offloads = 0
        self.reloads = 0
        self.step_no = 0

    @property
    def draft_ready(self) -> bool:
        return self.residency == RESIDENT

    def _residency_tick(self, now: float) -> None:
        if self.residency == "offloading" and now >= self.move_done_ms:
            self.residency, self.pool = OFFLOADED, self.big_pool
        elif self.reload_wanted and self.residency == OFFLOADED and self.reserved <= self.small_pool:
            self.residency, self.pool, self.move_done_ms = "reloading", self.small_pool, now + self.reload_ms
            self.reload_wanted = False
        elif self.residency == "reloading" and now >= self.move_done_ms:
            self.residency = RESIDENT
            self.seq[LAG, : self.n] = self.seq[CTX, : self.n]  # the draft's KV was dropped: rebuild it all

    def direct(self, residency: str, now: float) -> None:
        if residency == OFFLOADED and self.residency == RESIDENT:
            self.residency, self.move_done_ms = "offloading", now + self.offload_ms
            self.offloads += 1
        elif residency == RESIDENT and self.residency == OFFLOADED and not self.reload_wanted:
            self.reload_wanted = True
            self.reloads += 1

    def step(self, queue: deque, prompt: list[int], output: list[int], policy: GammaPolicy,
             uniforms: UniformBuffer, noise: float, first_token_ms: np.ndarray, done_ms: np.ndarray) -> bool:
        """Run one step at ``self.clock``; False when there is nothing to do (caller advances time)."""
        now = self.clock
        if self.residency != RESIDENT or self.reload_wanted:
            self._residency_tick(now)
        n = batch = self.n  # decode batch: sequences already past their prefill
        surface = self.surface
        # admit: FCFS while there is a batch slot and KV room (not while a reload waits to fit)
        new = []
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
        if n == 0 and not new:
            return False
        gamma = 0
        draft_ms = verify_ms = catchup_ms = 0.0
        catchup_tokens = emitted = 0
        accepted: tuple[int, ...] = ()
        seq = self.seq
        if n:
            if self.residency == RESIDENT:
                gamma = min(policy.select(Context(n, self.id)).gamma, self.gamma_max)
            draft_ms = surface.draft_ms[n][gamma]
            verify_ms = surface.verify_ms[n][gamma]
            if noise:
                f = uniforms.take(2)
                draft_ms *= 1.0 + noise * (2.0 * f[0] - 1.0)
                verify_ms *= 1.0 + noise * (2.0 * f[1] - 1.0)
            live = seq[:, :n]  # [5, n] view
            if gamma:
                catchup_tokens = int(live[LAG].sum())
                if catchup_tokens:
                    catchup_ms = surface.catchup_ms_fixed + surface.catchup_ms_per_token * catchup_tokens
                    live[LAG] = 0
                got = np.searchsorted(self.acceptance.cdf[gamma], uniforms.take(n), side="right")  # [n] in 0..γ
                counts = np.bincount(got, minlength=gamma + 1)  # [γ+1]
                accepted = tuple((n - np.cumsum(counts[:-1])).tolist())  # sequences accepting position i
                out = np.minimum(got + 1, live[REM])
                emitted = int(out.sum())
            else:
                out = np.minimum(live[REM], 1)
                emitted = int(out.sum())
                live[LAG] += out
            live[REM] -= out
            live[CTX] += out
            if gamma != self.last_gamma:
                self.switches += self.last_gamma >= 0
                self.last_gamma = gamma
        prefill_tokens = sum(prompt[r] for r in new)
        # New prompts ride in the same target forward as the decode rows (as in the engine), so
        # their time is part of verify_ms; the draft sees them at its next speculative step.
        verify_ms += surface.prefill_ms_per_token * prefill_tokens
        step_ms = draft_ms + verify_ms + catchup_ms
        end = now + step_ms
        self.clock = end
        if n:
            finished = seq[REM, :n] <= 0
            if finished.any():
                done = seq[:, :n][:, finished]  # [5, f]
                done_ms[done[REQ]] = end
                self.reserved -= int(done[RESV].sum())
                keep = seq[:, :n][:, ~finished]  # [5, k]
                n = keep.shape[1]
                seq[:, :n] = keep
        for r in new:
            first_token_ms[r] = end
            left = output[r] - 1
            need = prompt[r] + output[r] + self.gamma_max
            if left <= 0:
                done_ms[r] = end
                self.reserved -= need
                continue
            seq[:, n] = (r, left, prompt[r] + 1, prompt[r] + 1, need)  # draft lag: the whole prompt
            n += 1
        self.n = n
        if batch:  # a prefill-only step carries no decode measurement
            self.step_no += 1
            policy.update(StepStats(
                worker_id=self.id, step=self.step_no, unix_ms=int(end), batch_size=batch, gamma=gamma,
                draft_ms=draft_ms, verify_ms=verify_ms, step_ms=step_ms, accepted_per_position=accepted,
                emitted_tokens=emitted, prefill_tokens=prefill_tokens, catchup_tokens=catchup_tokens,
                catchup_ms=catchup_ms, kv_blocks_used=-(-self.reserved // self.block_tokens),
                kv_blocks_free=max(self.pool - self.reserved, 0) // self.block_tokens, waiting=len(queue),
                draft_residency=self.residency))
            self.direct(policy.residency_for(self.id), end)
        return True
