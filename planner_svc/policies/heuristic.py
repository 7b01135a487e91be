"""``heuristic``: transformers' assisted-generation schedule, one γ for every batch size.

After each speculative step: γ ← min(γmax, γ + 2) if every sequence accepted all γ draft
tokens, else γ ← max(1, γ − 1). It never turns speculation off (γ ≥ 1), which is why it loses
at high load.
"""

from __future__ import annotations

from typing import Any

from nightjar.messages import StepStats
from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy


class HeuristicPolicy(GammaPolicy):
    name = "heuristic"

    def __init__(self, *, gamma_max: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        super().__init__(gamma_max=gamma_max, buckets=buckets)
        self.arm = gamma_max

    def gamma_for(self, batch_size: int) -> int:
        return self.arm

    def update(self, stats: StepStats) -> None:
        if stats.gamma <= 0 or stats.batch_size <= 0 or len(stats.accepted_per_position) < stats.gamma:
            return
        all_accepted = stats.accepted_per_position[stats.gamma - 1] >= stats.batch_size
        self.arm = min(self.gamma_max, self.arm + 2) if all_accepted else max(min(1, self.gamma_max), self.arm - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"arm": self.arm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "arm" in state:
            self.arm = max(0, min(int(state["arm"]), self.gamma_max))
