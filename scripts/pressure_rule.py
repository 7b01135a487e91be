"""PressureRule: a local draft-residency directive from memory pressure, until the planner decides.

A pure object with one method, called by MemoryManager.poll every step
(``engine.memory.set_directive_source(PressureRule())``). Used by scripts/bench_memory.py and
the memory tests; the serving stack takes its directives from the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nightjar.messages import Residency
from worker.engine.memory import MemoryPressure


@dataclass
class PressureRule:
    """Per step:
    offload when requests have waited for admission for ``offload_after`` consecutive steps
            (sustained pressure: the KV pool, not a burst, is what limits the batch);
    reload  when nothing has waited for ``reload_after`` consecutive steps and the blocks in use
            are at most ``reload_below`` of the base pool (so the squeeze needs no preemption
            and leaves room to grow).
    """

    offload_after: int = 3  # steps with requests waiting
    reload_after: int = 20  # steps without
    reload_below: float = 0.6  # share of the base pool in use at most
    _waiting_steps: int = field(default=0, repr=False)
    _calm_steps: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.offload_after < 1 or self.reload_after < 1:
            raise ValueError("PressureRule: offload_after and reload_after must be >= 1 step")
        if not 0.0 < self.reload_below <= 1.0:
            raise ValueError("PressureRule: reload_below must be in (0, 1]")

    def __call__(self, p: MemoryPressure) -> str:
        if p.waiting:
            self._waiting_steps += 1
            self._calm_steps = 0
        else:
            self._waiting_steps = 0
            self._calm_steps += 1
        away = p.state in (Residency.OFFLOADING, Residency.OFFLOADED)
        if not away and self._waiting_steps >= self.offload_after:
            return Residency.OFFLOADED
        if away and self._calm_steps >= self.reload_after and p.blocks_used <= self.reload_below * p.base_blocks:
            return Residency.RESIDENT
        return Residency.OFFLOADED if away else Residency.RESIDENT
