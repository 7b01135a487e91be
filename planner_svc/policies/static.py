"""Static baselines: ``off``, ``fixed:γ``, ``threshold:B`` and ``table:…`` are one object.

γ(B) = value of the smallest key >= B in a {batch upper bound: γ} table; past the largest key,
that key's value. ``off`` = {1: 0}; ``fixed:g`` = {1: g}; ``threshold:B`` = {B: g_default, B+1: 0}
(vLLM's old ``speculative_disable_by_batch_size``); ``table:1=4,4=2,16=1,32=0`` is vLLM's static
per-batch-size table. Nothing is learned.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy


@dataclass(frozen=True)
class StaticSettings:
    keys: tuple[int, ...]  # ascending batch-size upper bounds
    gammas: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.keys or len(self.keys) != len(self.gammas):
            raise ValueError("a static table needs at least one 'batch=gamma' entry")
        if list(self.keys) != sorted(set(self.keys)) or self.keys[0] < 1:
            raise ValueError(f"static table batch sizes must be distinct, ascending and >= 1, got {self.keys}")
        if any(g < 0 for g in self.gammas):
            raise ValueError(f"static table gammas must be >= 0, got {self.gammas}")


class StaticPolicy(GammaPolicy):
    def __init__(self, settings: StaticSettings, *, gamma_max: int, name: str,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        super().__init__(gamma_max=gamma_max, buckets=buckets)
        if max(settings.gammas) > gamma_max:
            raise ValueError(f"{name}: gamma {max(settings.gammas)} exceeds gamma_max={gamma_max}")
        self.settings = settings
        self.name = name
        top = max(max(settings.keys), max(buckets)) + 1
        # Pre-resolved γ for every batch size up to the largest key: select() is a list index.
        self._by_batch = [self._lookup(b) for b in range(top + 1)]

    def _lookup(self, batch_size: int) -> int:
        i = min(bisect.bisect_left(self.settings.keys, batch_size), len(self.settings.keys) - 1)
        return self.settings.gammas[i]

    def gamma_for(self, batch_size: int) -> int:
        if batch_size < len(self._by_batch):
            return self._by_batch[max(batch_size, 0)]
        return self._by_batch[-1]
