"""The interface every γ policy implements, and the records it exchanges with its caller.

A policy is a small pure object (MABWiser / Open Bandit Pipeline style): seeded, settings in a
frozen dataclass, ``select(context) -> Decision`` is a pure look-up of the current state and
``update(stats)`` is the only thing that changes it. The service and the simulator feed it the
same ``StepStats`` records, so what is tested in the simulator is what runs in production.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from nightjar.messages import Residency, StepStats

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Context:
    """What a γ decision depends on: the decode batch size (→ its bucket) and the worker."""

    batch_size: int
    worker_id: str = ""


@dataclass(frozen=True)
class SurfacePrior:
    """An offline cost surface as a policy's prior: per measured batch size, draft and verify ms
    of one step at each γ ([len(batch_sizes)][γ+1]), and per-position acceptance."""

    batch_sizes: tuple[int, ...]
    draft_ms: tuple[tuple[float, ...], ...]
    verify_ms: tuple[tuple[float, ...], ...]
    acceptance: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        if not n or len(self.draft_ms) != n or len(self.verify_ms) != n:
            raise ValueError("a surface prior needs draft_ms and verify_ms rows for every batch size")
        if any(len(d) != len(v) or min(v) <= 0 or min(d) < 0 for d, v in zip(self.draft_ms, self.verify_ms)):
            raise ValueError("a surface prior's rows must be as long as each other, verify_ms > 0, draft_ms >= 0")


@dataclass(frozen=True)
class Decision:
    gamma: int
    residency: str = Residency.RESIDENT  # directive for the context's worker


def bucket_index(bounds: tuple[int, ...], batch_size: int) -> int:
    """Index of the first bucket whose upper bound is >= batch_size (the last one covers the rest)."""
    return min(bisect.bisect_left(bounds, batch_size), len(bounds) - 1)


def validate_buckets(bounds: tuple[int, ...]) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in bounds)
    if not bounds or any(b < 1 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"bucket upper bounds must be distinct positive ascending integers, got {bounds}")
    return bounds


class GammaPolicy(ABC):
    """Base class: picks γ ∈ {0..gamma_max} per batch-size bucket, optionally draft residency."""

    name: str = "policy"

    def __init__(self, *, gamma_max: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        if not 0 <= gamma_max <= 16:
            raise ValueError(f"gamma_max must be in 0..16, got {gamma_max}")
        self.gamma_max = gamma_max
        self.buckets = validate_buckets(buckets)

    @abstractmethod
    def gamma_for(self, batch_size: int) -> int:
        """γ the policy currently wants for this batch size (pure look-up)."""

    def residency_for(self, worker_id: str) -> str:
        return Residency.RESIDENT

    def select(self, context: Context) -> Decision:
        return Decision(self.gamma_for(context.batch_size), self.residency_for(context.worker_id))

    def update(self, stats: StepStats) -> None:  # noqa: B027 - static policies learn nothing
        """Learn from one engine step."""

    def warm_start(self, prior: SurfacePrior) -> None:  # noqa: B027 - only model-based policies use one
        """Start from an offline cost surface (a prior that live steps then override)."""

    def table(self) -> tuple[int, ...]:
        """γ per bucket (what the service publishes); the bucket's upper bound stands for it."""
        return tuple(self.gamma_for(b) for b in self.buckets)

    def residency(self) -> dict[str, str]:
        """Residency directive per worker seen so far (empty for policies that never offload)."""
        return {}

    # --- persistence (msgpack-able plain data), so a restarted planner resumes ---------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore what ``state_dict`` returned."""
