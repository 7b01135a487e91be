"""The hindsight oracle: the best γ for every exact batch size, given the true costs and acceptance.

γ*(B) = argmin_γ (draft(B, γ) + verify(B, γ)) / E(γ), with E from the true acceptance process.
It knows what no online policy can, which makes it the yardstick of the tests.
"""

from __future__ import annotations

from planner_svc.policies.base import DEFAULT_BUCKETS
from planner_svc.policies.static import StaticPolicy, StaticSettings
from planner_svc.simulator.acceptance_process import AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface


def oracle_gammas(surface: CostSurface, acceptance: AcceptanceProcess, gamma_max: int, max_batch: int) -> list[int]:
    out = []
    for b in range(1, max_batch + 1):
        losses = [surface.step_ms(b, g) / acceptance.expected[g] for g in range(gamma_max + 1)]
        out.append(min(range(gamma_max + 1), key=losses.__getitem__))
    return out


def oracle_policy(surface: CostSurface, acceptance: AcceptanceProcess, gamma_max: int, max_batch: int) -> StaticPolicy:
    gammas = oracle_gammas(surface, acceptance, gamma_max, max_batch)
    return StaticPolicy(StaticSettings(tuple(range(1, max_batch + 1)), tuple(gammas)), gamma_max=gamma_max,
                        name="oracle", buckets=DEFAULT_BUCKETS)
