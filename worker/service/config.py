"""The worker service's one frozen, validated configuration (built in ``worker.__main__``)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nightjar import paths
from nightjar.service_util import check_redis_url
from worker.engine.config import EngineConfig

__all__ = ["EngineConfig", "WorkerServiceConfig"]  # the worker's command line builds both


def _default_worker_id() -> str:
    # Unique per process: a restarted worker is a new worker, and the scheduler re-dispatches
    # what the old one left unfinished once its heartbeat expires.
    return f"w-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def _default_engine() -> EngineConfig:
    return EngineConfig(target_path=str(paths.DEFAULT_TARGET), draft_path=str(paths.DEFAULT_DRAFT))


@dataclass(frozen=True)
class WorkerServiceConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "nj"
    worker_id: str = field(default_factory=_default_worker_id)
    # the models, the device, the KV budget, γ's range and its default while no fresh policy
    # is known (0 = safe under any load), torch threads: the engine's own validated settings
    engine: EngineConfig = field(default_factory=_default_engine)
    policy_ttl_s: float = 10.0  # a policy older than this is ignored (default γ instead)
    # The engine loop in a child process instead of a thread (worker/host/process.py): on a GPU
    # the step is Python launching kernels and would share the GIL with the Redis side.
    # None = a process on CUDA, a thread on the CPU (where the matrix work releases the GIL).
    engine_process: bool | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 2.0  # the scheduler declares the worker dead this long after its last beat
    cancel_poll_s: float = 1.0  # key check for cancels missed on the channel (e.g. during a reconnect)
    output_ttl_s: float = 600.0  # output streams expire after this even if no gateway reads them
    stats_maxlen: int = 10_000  # the stats stream is capped (approximately) at this many entries
    read_count: int = 64  # inbox entries per XREADGROUP
    drain_grace_s: float = 30.0  # SIGTERM: running requests may finish for this long
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"  # /metrics interface: loopback unless told (compose: the container's network)
    log_level: str = "INFO"
    log_format: str = "text"  # nightjar.service_util.LOG_FORMATS
    served_model_name: str = ""  # the gateway's name for the model; "" = the target folder's name

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url, self.key_prefix)
        if not self.worker_id or any(c in self.worker_id for c in ": \t\n*"):
            raise ValueError(f"worker_id must be non-empty without ':', '*' or spaces, got {self.worker_id!r}")
        if self.heartbeat_ttl_s < 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be at least twice heartbeat_interval_s, or one late beat kills the worker")
        for name in ("heartbeat_interval_s", "policy_ttl_s", "cancel_poll_s", "output_ttl_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("stats_maxlen", "read_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def use_engine_process(self) -> bool:
        return self.engine.device.startswith("cuda") if self.engine_process is None else self.engine_process

    @property
    def model_name(self) -> str:
        """What heartbeats and the metrics' model_name label say: the gateway's name for it."""
        return self.served_model_name or Path(self.engine.target_path).name

    @property
    def default_gamma(self) -> int:
        """γ while no fresh policy is known: the engine's default, 0 without a draft."""
        return self.engine.default_gamma if self.engine.draft_path else 0
