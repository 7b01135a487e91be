"""``ucb``: BanditSpec-style UCB1 over γ with no context (one γ for every batch size).

Reward of a step r = emitted tokens / (draft + verify ms), divided by the largest reward seen so
far so it lies in [0, 1]. After each step the arm is
    γ = argmax_a  mean_a + c · sqrt(2 ln N / n_a)        (unplayed arms first)
with N steps so far and n_a plays of arm a. It ignores batch size, so it cannot follow load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nightjar.messages import StepStats
from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy


@dataclass(frozen=True)
class UcbSettings:
    exploration: float = 0.5  # c: 1 is textbook UCB1; rewards are noisy but well scaled, so less

    def __post_init__(self) -> None:
        if not self.exploration >= 0:
            raise ValueError(f"ucb exploration must be >= 0, got {self.exploration}")


class UcbPolicy(GammaPolicy):
    name = "ucb"

    def __init__(self, settings: UcbSettings = UcbSettings(), *, gamma_max: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        super().__init__(gamma_max=gamma_max, buckets=buckets)
        self.settings = settings
        self.sums = [0.0] * (gamma_max + 1)
        self.plays = [0] * (gamma_max + 1)
        self.best_rate = 1e-9
        self.arm = gamma_max

    def gamma_for(self, batch_size: int) -> int:
        return self.arm

    def update(self, stats: StepStats) -> None:
        ms = stats.draft_ms + stats.verify_ms
        if ms <= 0 or stats.batch_size <= 0 or not 0 <= stats.gamma <= self.gamma_max:
            return
        rate = stats.emitted_tokens / ms
        if rate > self.best_rate:
            # Rescale past sums so every stored reward stays relative to the best rate seen.
            scale = self.best_rate / rate
            self.sums = [s * scale for s in self.sums]
            self.best_rate = rate
        self.sums[stats.gamma] += rate / self.best_rate
        self.plays[stats.gamma] += 1
        self.arm = self._choose()

    def _choose(self) -> int:
        for arm, n in enumerate(self.plays):
            if n == 0:
                return arm
        log_n = math.log(sum(self.plays))
        c = self.settings.exploration
        scores = [s / n + c * math.sqrt(2 * log_n / n) for s, n in zip(self.sums, self.plays)]
        return max(range(len(scores)), key=scores.__getitem__)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums, "plays": self.plays, "best_rate": self.best_rate, "arm": self.arm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("plays", ())) == self.gamma_max + 1:
            self.sums = [float(x) for x in state["sums"]]
            self.plays = [int(x) for x in state["plays"]]
            self.best_rate = float(state["best_rate"])
            self.arm = min(int(state["arm"]), self.gamma_max)
