"""``ema``: SGLang's ``--speculative-adaptive`` (its default "ema" strategy), as a γ policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nightjar.messages import StepStats
from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy


@dataclass(frozen=True)
class EmaTier:
    min_batch: int
    candidates: tuple[int, ...]
    down_hysteresis: float = 0.0


def _default_tiers() -> tuple[EmaTier, ...]:
    return (EmaTier(1, (1, 3, 5, 7), -0.25), EmaTier(8, (0, 1, 3)), EmaTier(32, (0, 1)), EmaTier(64, (0,)))


@dataclass(frozen=True)
class EmaSettings:
    tiers: tuple[EmaTier, ...] = field(default_factory=_default_tiers)
    alpha: float = 0.2
    warmup: int = 10
    interval: int = 5

    def __post_init__(self) -> None:
        if not self.tiers or [t.min_batch for t in self.tiers] != sorted({t.min_batch for t in self.tiers}):
            raise ValueError("tiers need distinct ascending min_batch values")
        if self.tiers[0].min_batch != 1 or any(not t.candidates or min(t.candidates) < 0 for t in self.tiers):
            raise ValueError("the first tier starts at batch 1 and every tier has candidates >= 0")
        if not 0 < self.alpha <= 1 or self.warmup < 0 or self.interval < 1:
            raise ValueError("need 0 < alpha <= 1, warmup >= 0, interval >= 1")


class _Slot:
    def __init__(self, tier: EmaTier, gamma_max: int) -> None:
        self.candidates = sorted({min(c, gamma_max) for c in tier.candidates})
        self.down_hysteresis = tier.down_hysteresis
        self.arm = self.candidates[len(self.candidates) // 2]
        self.ema = float(self.arm - 1)
        self.steps = 0


class EmaPolicy(GammaPolicy):
    """Per batch-size tier (SGLang's default tiers: batch 1-7 → γ ∈ {1,3,5,7}, 8-31 → {0,1,3},
    32-63 → {0,1}, 64+ → {0}; candidates above γmax are dropped), an EMA of the accepted draft
    length per request (α = 0.2) drives the tier's γ. After ``warmup`` steps, every ``interval``
    steps of the tier: step down while ema <= previous candidate − 0.5 (0.5 for 0, plus the
    down-hysteresis −0.25 at tier 1), else step up while ema > current − 0.5; from γ = 0 it
    always probes the next candidate up. No cost model: the tiers are its only notion of load.
    (sglang/srt/speculative/adaptive_spec_params.py, ``AdaptiveStepSlot``.)
    """

    name = "ema"

    def __init__(self, settings: EmaSettings = EmaSettings(), *, gamma_max: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        super().__init__(gamma_max=gamma_max, buckets=buckets)
        self.settings = settings
        self.slots = [_Slot(t, gamma_max) for t in settings.tiers]
        self._mins = [t.min_batch for t in settings.tiers]

    def _slot(self, batch_size: int) -> _Slot:
        i = 0
        while i + 1 < len(self._mins) and batch_size >= self._mins[i + 1]:
            i += 1
        return self.slots[i]

    def gamma_for(self, batch_size: int) -> int:
        return self._slot(batch_size).arm

    def update(self, stats: StepStats) -> None:
        if stats.batch_size <= 0:
            return
        s, slot = self.settings, self._slot(stats.batch_size)
        if stats.gamma > 0 and stats.gamma == slot.arm:
            accepted = sum(stats.accepted_per_position) / stats.batch_size  # drafts accepted per request
            slot.ema = (1 - s.alpha) * slot.ema + s.alpha * accepted
        slot.steps += 1
        if slot.steps > s.warmup and (slot.steps - s.warmup) % s.interval == 0:
            slot.arm = self._recompute(slot)

    @staticmethod
    def _recompute(slot: _Slot) -> int:
        c = slot.candidates
        i = c.index(slot.arm)
        if slot.arm == 0:  # probe the smallest positive candidate after a γ=0 interval
            i = min(i + 1, len(c) - 1)
            if c[i] > 0 and slot.ema < 0:
                slot.ema = float(c[i] - 1)
            return c[i]
        start = i
        while i > 0 and slot.ema <= (0.5 if c[i - 1] == 0 else c[i - 1] - 0.5) + slot.down_hysteresis:
            i -= 1
        if i == start:
            while i + 1 < len(c) and slot.ema > c[i] - 0.5:
                i += 1
        return c[i]

    def state_dict(self) -> dict[str, Any]:
        return {"slots": [{"arm": sl.arm, "ema": sl.ema, "steps": sl.steps} for sl in self.slots]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state.get("slots", [])
        if len(rows) != len(self.slots):
            return
        for sl, row in zip(self.slots, rows):
            if int(row.get("arm", -1)) in sl.candidates:
                sl.arm, sl.ema, sl.steps = int(row["arm"]), float(row["ema"]), int(row["steps"])
