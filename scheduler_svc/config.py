"""The scheduler's one frozen, validated configuration (built in ``scheduler_svc.__main__``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from nightjar.dispatch_lease import ASSIGNMENT_TTL_S
from nightjar.service_util import check_redis_url


def _default_consumer() -> str:
    # Unique per process: a restarted scheduler is a new consumer and reclaims (XAUTOCLAIM)
    # what its dead predecessor left pending.
    return f"sched-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class SchedulerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "nj"
    consumer: str = field(default_factory=_default_consumer)
    read_count: int = 128  # jobs taken per XREADGROUP
    read_block_ms: int = 500  # XREADGROUP BLOCK; also how often a stop request is noticed
    max_deliveries: int = 5  # a queue entry delivered more often than this is dead-lettered
    max_attempts: int = 3  # a job whose workers died this often fails with an error chunk
    claim_idle_ms: int = 10_000  # entries pending this long on another consumer are reclaimed
    claim_interval_s: float = 1.0
    heartbeat_check_s: float = 0.25  # how often worker liveness is checked
    output_ttl_s: float = 600.0  # error chunks written by the scheduler expire like worker output
    assignment_ttl_s: float = ASSIGNMENT_TTL_S  # a leaked assignment record disappears after this
    lease_ttl_s: float = 1.0  # the lease table outlives the scheduler by this much (nightjar.dispatch_lease)
    dead_letter_maxlen: int = 10_000
    # A worker with work whose engine takes no step for this long is stalled (dead for
    # dispatch; its jobs re-dispatched). Above any single step: a long prefill on a CPU is seconds.
    stall_s: float = 10.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"  # /metrics interface: loopback unless told (compose: the container's network)
    log_level: str = "INFO"
    log_format: str = "text"  # nightjar.service_util.LOG_FORMATS

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url, self.key_prefix)
        for name in ("read_count", "read_block_ms", "max_deliveries", "max_attempts", "claim_idle_ms", "dead_letter_maxlen"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("claim_interval_s", "heartbeat_check_s", "output_ttl_s", "assignment_ttl_s", "lease_ttl_s", "stall_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.lease_ttl_s < 2 * self.heartbeat_check_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must cover two heartbeat checks ({self.heartbeat_check_s}s each)")
        if not self.consumer:
            raise ValueError("consumer name must be non-empty")
