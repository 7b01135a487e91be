"""The policy calls one simulated step makes, skipping those a policy does not override.

``select`` is a pure look-up of state that only ``update`` changes (base.py), so a policy that
keeps the base no-op ``update`` has one fixed γ per batch size: it is asked once per size and
fed no StepStats. One that keeps the base ``residency_for`` never offloads, so there is no
directive to apply. Learning policies go through select and update on every step, unchanged.
"""

from __future__ import annotations

from typing import Callable

from nightjar.messages import Residency, StepStats
from planner_svc.policies.base import Context, GammaPolicy


class PolicyCalls:
    def __init__(self, policy: GammaPolicy) -> None:
        cls = type(policy)
        self.policy = policy
        self.learns = cls.update is not GammaPolicy.update
        self.directs = cls.residency_for is not GammaPolicy.residency_for
        # The base select is Decision(gamma_for(B), residency_for(worker)): its γ is gamma_for(B).
        self.plain_select = cls.select is GammaPolicy.select
        self.fixed: dict[int, int] = {}  # batch size -> γ, for policies that learn nothing
        # Bound once: these run on every step, and each extra Python call level shows.
        self.update: Callable[[StepStats], None] = policy.update
        self.residency_for: Callable[[str], str] = policy.residency_for if self.directs else _resident

    def gamma(self, batch_size: int, worker_id: str) -> int:
        if not self.plain_select:
            return self.policy.select(Context(batch_size, worker_id)).gamma
        if self.learns:
            return self.policy.gamma_for(batch_size)
        gamma = self.fixed.get(batch_size)
        if gamma is None:
            gamma = self.fixed[batch_size] = self.policy.gamma_for(batch_size)
        return gamma


def _resident(worker_id: str) -> str:
    return Residency.RESIDENT
