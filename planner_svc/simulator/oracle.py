"""The hindsight oracle: the best γ for every exact batch size, given the true costs and acceptance.

γ*(B) = argmin_γ (draft(B, γ) + verify(B, γ)) / E(γ), with E from the true acceptance process.
It knows what no online policy can, which makes it the yardstick of the tests.
"""

from __future__ import annotations

from pathlib import Path

from planner_svc.policies.base import DEFAULT_BUCKETS
from planner_svc.policies.static import StaticPolicy, StaticSettings
from planner_svc.simulator.acceptance_process import DEFAULT_ALPHAS, AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface, load_table


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


def surface_gammas(path: str | Path, gamma_max: int, max_batch: int = 256) -> list[int]:
    """A measured surface file's best γ at every batch size 1..max_batch, acceptance the file's
    (else the default): what an offline profile tells vLLM's static tables."""
    surface = load_table(path, max_batch)
    return oracle_gammas(surface, AcceptanceProcess(surface.acceptance or DEFAULT_ALPHAS, gamma_max), gamma_max, max_batch)


def table_of(gammas: list[int]) -> dict[int, int]:
    """γ per batch size 1.. as a static table {batch upper bound: γ} (StaticSettings' form: the
    last entry holds beyond it), one entry per run of equal γ."""
    table = {b: g for b, (g, after) in enumerate(zip(gammas, gammas[1:]), start=1) if g != after}
    table[max(table, default=0) + 1] = gammas[-1]  # the last run, keyed by its first batch size
    return table
