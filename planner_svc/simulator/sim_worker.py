"""One simulated worker: continuous batching over a KV budget, speculative steps, draft residency.

Per step (mirrors the engine): finish residency moves → admit queued requests that fit →
γ = policy(batch) (0 while the draft is away) → draft catch-up if γ>0 and the draft is behind →
draft γ passes + verify → accept (sampled) → emit → publish StepStats to the policy.
Sequences live in numpy arrays (struct of arrays), so a step costs a handful of numpy calls.

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
        self.req = np.zeros(max_batch, dtype=np.int64)  # request index
        self.rem = np.zeros(max_batch, dtype=np.int64)  # output tokens still to emit
        self.ctx = np.zeros(max_batch, dtype=np.int64)  # tokens in the target's KV
        self.lag = np.zeros(max_batch, dtype=np.int64)  # tokens missing from the draft's KV
        self.resv = np.zeros(max_batch, dtype=np.int64)  # reserved KV tokens
        self.reserved = 0
        self.residency = RESIDENT  # resident | offloading | offloaded | reloading (+ waiting to fit)
        self.move_done_ms = 0.0
        self.reload_wanted = False
        self.last_gamma = -1
        self.steps = 0
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
            self.lag[: self.n] = self.ctx[: self.n]  # the draft's KV was dropped: rebuild it all

    def direct(self, residency: str, now: float) -> None:
        if residency == OFFLOADED and self.residency == RESIDENT:
            self.residency, self.move_done_ms = "offloading", now + self.offload_ms
            self.offloads += 1
        elif residency == RESIDENT and self.residency == OFFLOADED and not self.reload_wanted:
            self.reload_wanted = True
            self.reloads += 1

    def step(self, queue: deque, trace_prompt: np.ndarray, trace_output: np.ndarray, policy: GammaPolicy,
             rng: np.random.Generator, noise: float, first_token_ms: np.ndarray, done_ms: np.ndarray) -> bool:
        """Run one step at ``self.clock``; False when there is nothing to do (caller advances time)."""
        now = self.clock
        self._residency_tick(now)
        n = batch = self.n  # decode batch: sequences already past their prefill
        surface = self.surface
        # admit: FCFS while there is a batch slot and KV room (not while a reload waits to fit)
        new = []
        while queue and n + len(new) < self.max_batch and not self.reload_wanted:
            r = queue[0]
            need = int(trace_prompt[r] + trace_output[r]) + self.gamma_max
            if self.reserved + need > self.pool:
                break
            queue.popleft()
            self.reserved += need
            new.append((r, need))
        if n == 0 and not new:
            return False
        gamma = 0
        draft_ms = verify_ms = catchup_ms = 0.0
        catchup_tokens = 0
        accepted = ()
        emitted = 0
        if n:
            if self.draft_ready:
                gamma = min(policy.select(Context(n, self.id)).gamma, self.gamma_max)
            draft_ms = surface.draft_ms[n][gamma]
            verify_ms = surface.verify_ms[n][gamma]
            if noise:
                f = 1.0 + noise * (2.0 * rng.random(2) - 1.0)
                draft_ms *= f[0]
                verify_ms *= f[1]
            rem, lag, ctx = self.rem[:n], self.lag[:n], self.ctx[:n]
            if gamma:
                catchup_tokens = int(lag.sum())
                if catchup_tokens:
                    catchup_ms = surface.catchup_ms_fixed + surface.catchup_ms_per_token * catchup_tokens
                    lag[:] = 0
                got = self.acceptance.sample(rng, n, gamma)  # [n]
                counts = np.bincount(got, minlength=gamma + 1)  # [γ+1]
                accepted = tuple((n - np.cumsum(counts)[:-1]).tolist())  # sequences accepting position i
                out = np.minimum(got + 1, rem)
            else:
                out = np.minimum(1, rem)
                lag += out
            rem -= out
            ctx += out
            emitted = int(out.sum())
            if gamma != self.last_gamma:
                self.switches += self.last_gamma >= 0
                self.last_gamma = gamma
        prefill_tokens = 0
        for r, _ in new:
            prefill_tokens += int(trace_prompt[r])
        prefill_ms = surface.prefill_ms_per_token * prefill_tokens
        draft_prefill = gamma > 0  # the draft only runs (and prefills) in speculative steps
        if draft_prefill:
            prefill_ms *= 1.0 + surface.draft_prefill_ratio
        step_ms = draft_ms + verify_ms + catchup_ms + prefill_ms
        end = now + step_ms
        self.clock = end
        if n:
            finished = self.rem[:n] <= 0
            if finished.any():
                done_ms[self.req[:n][finished]] = end
                keep = ~finished
                k = int(keep.sum())
                self.reserved -= int(self.resv[:n][finished].sum())
                for arr in (self.req, self.rem, self.ctx, self.lag, self.resv):
                    arr[:k] = arr[:n][keep]
                n = k
        for r, need in new:
            first_token_ms[r] = end
            left = int(trace_output[r]) - 1
            if left <= 0:
                done_ms[r] = end
                self.reserved -= need
                continue
            self.req[n], self.rem[n], self.ctx[n], self.resv[n] = r, left, trace_prompt[r] + 1, need
            self.lag[n] = 1 if draft_prefill else trace_prompt[r] + 1
            n += 1
        self.n = n
        if batch:  # a prefill-only step carries no decode measurement
            self.step_no += 1
            stats = StepStats(
                worker_id=self.id, step=self.step_no, unix_ms=int(end), batch_size=batch, gamma=gamma,
                draft_ms=draft_ms, verify_ms=verify_ms, step_ms=step_ms, accepted_per_position=accepted,
                emitted_tokens=emitted, prefill_tokens=prefill_tokens, catchup_tokens=catchup_tokens,
                catchup_ms=catchup_ms, kv_blocks_used=-(-self.reserved // self.block_tokens),
                kv_blocks_free=max(self.pool - self.reserved, 0) // self.block_tokens, waiting=len(queue),
                draft_residency=self.residency)
            policy.update(stats)
            self.direct(policy.residency_for(self.id), end)
        return True
