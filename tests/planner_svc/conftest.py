"""Helpers of the planner's simulator tests."""

from __future__ import annotations

import numpy as np

from nightjar.messages import Residency, StepStats
from planner_svc.policies import GammaPolicy
from planner_svc.policies.base import Context, Decision
from planner_svc.simulator.trace import Trace, piecewise_poisson, synthetic_lengths


class Recorder(GammaPolicy):
    """Delegates to a policy and keeps every StepStats it was fed (test-only)."""

    def __init__(self, inner: GammaPolicy) -> None:
        super().__init__(gamma_max=inner.gamma_max, buckets=inner.buckets)
        self.inner, self.name, self.seen = inner, inner.name, []

    def gamma_for(self, batch_size: int) -> int:
        return self.inner.gamma_for(batch_size)

    def select(self, context: Context) -> Decision:
        return self.inner.select(context)

    def residency_for(self, worker_id: str) -> str:
        return self.inner.residency_for(worker_id)

    def update(self, stats: StepStats) -> None:
        self.seen.append(stats)
        self.inner.update(stats)


def high_then_low(seed: int) -> Trace:
    """~4x capacity for 20 s, then nearly idle for 60 s."""
    rng = np.random.default_rng(seed)
    arrivals = piecewise_poisson(rng, [60.0, 0.5], [20.0, 60.0])
    prompt, output = synthetic_lengths(rng, len(arrivals))
    return Trace("high-then-low", arrivals, prompt, output)


def stats(batch: int, gamma: int, *, verify_ms: float = 5.0, draft_ms: float = 0.0, accepted=(), emitted: int = 0,
          worker: str = "w0", used: int = 10, free: int = 90, waiting: int = 0, residency: str = Residency.RESIDENT,
          catchup_ms: float = 0.0, catchup_tokens: int = 0) -> StepStats:
    return StepStats(worker_id=worker, step=0, unix_ms=0, batch_size=batch, gamma=gamma, draft_ms=draft_ms,
                     verify_ms=verify_ms, step_ms=draft_ms + verify_ms, accepted_per_position=tuple(accepted),
                     emitted_tokens=emitted or batch, kv_blocks_used=used, kv_blocks_free=free, waiting=waiting,
                     draft_residency=residency, catchup_ms=catchup_ms, catchup_tokens=catchup_tokens)
