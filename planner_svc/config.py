"""The planner's one frozen, validated configuration (built in ``planner_svc.__main__``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from nightjar.service_util import check_redis_url
from planner_svc.policies import DEFAULT_BUCKETS, make_policy
from planner_svc.policies.base import validate_buckets


def _default_consumer() -> str:
    return f"planner-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PlannerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "nj"
    policy: str = "nightjar"  # a make_policy spec: nightjar, off, fixed:3, table:1=4,16=0, ...
    # Below the workers' ceiling (6) on purpose: the extra arms cost more exploration than the
    # deep γ gains (BENCHMARKS.md, "Figures that were code comments").
    gamma_max: int = 4
    ttl_s: float = 10.0  # workers fall back to their default γ when the policy is older than this
    seed: int = 0
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # batch-size bucket upper bounds
    consumer: str = field(default_factory=_default_consumer)
    read_count: int = 512  # stats entries per XREADGROUP
    read_block_ms: int = 200  # XREADGROUP BLOCK; also how often a stop request is noticed
    # At most one read per interval while stats flow: decisions fall at bin ends (>= 8 steps), so a
    # read per engine step would only spend round trips (CPU beside the engine on a small host).
    read_interval_ms: int = 50
    save_interval_s: float = 5.0  # state snapshot to Redis at least this often while learning
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"  # /metrics interface: loopback unless told (compose: the container's network)
    log_level: str = "INFO"
    log_format: str = "text"  # nightjar.service_util.LOG_FORMATS
    # An offline cost surface (scripts/bench_speculation.py's JSON) to warm-start a model-based
    # policy from; live steps override it. None: learn everything online.
    prior_surface: str | None = None

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url, self.key_prefix)
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError(f"key_prefix must be non-empty and without ':', got {self.key_prefix!r}")
        if not 0 <= self.gamma_max <= 16:
            raise ValueError(f"gamma_max must be in 0..16, got {self.gamma_max}")
        if not self.ttl_s > 0.3:
            raise ValueError(f"ttl_s must be > 0.3 seconds (the policy is republished every ttl/3), got {self.ttl_s}")
        validate_buckets(self.buckets)
        make_policy(self.policy, gamma_max=self.gamma_max, seed=self.seed, buckets=self.buckets)  # raises if bad
        if self.read_count < 1 or self.read_block_ms < 1 or self.read_interval_ms < 0 or not self.save_interval_s > 0:
            raise ValueError("read_count and read_block_ms must be >= 1, read_interval_ms >= 0, save_interval_s > 0")
        if not self.consumer:
            raise ValueError("consumer name must be non-empty")
        if self.prior_surface is not None:
            self.surface_prior()  # raises with the file's problem

    def surface_prior(self):
        """The --prior-surface file as a policy prior (None without one)."""
        if self.prior_surface is None:
            return None
        from planner_svc.simulator.cost_surface import load_table

        return load_table(self.prior_surface, max_batch=max(256, self.buckets[-1])).prior()

    @property
    def republish_s(self) -> float:
        """Re-publish an unchanged policy this often so no worker sees it go stale."""
        return self.ttl_s / 3.0
