"""The worker service's one frozen, validated configuration (built in ``worker.__main__``)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nightjar import paths
from nightjar.service_util import check_redis_url


def _default_worker_id() -> str:
    # Unique per process: a restarted worker is a new worker, and the scheduler re-dispatches
    # what the old one left unfinished once its heartbeat expires.
    return f"w-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass(frozen=True)
class WorkerServiceConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "nj"
    worker_id: str = field(default_factory=_default_worker_id)
    target_path: Path = paths.DEFAULT_TARGET
    draft_path: Path | None = paths.DEFAULT_DRAFT  # None = no speculation
    device: str = "cpu"
    dtype: str = "float32"
    kv_budget_bytes: int | None = None  # None = the engine's default
    max_running: int = 64
    max_model_len: int | None = None  # prompt + completion cap; None = the models' own
    gamma_max: int = 6
    default_gamma: int = 0  # γ while no fresh policy is known (0 = safe under any load)
    policy_ttl_s: float = 10.0  # a policy older than this is ignored (default γ instead)
    num_threads: int | None = None  # torch CPU threads
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
        check_redis_url(self.redis_url)
        if not self.worker_id or any(c in self.worker_id for c in ": \t\n*"):
            raise ValueError(f"worker_id must be non-empty without ':', '*' or spaces, got {self.worker_id!r}")
        if not (self.target_path / "config.json").is_file():
            raise ValueError(f"--target {self.target_path} has no config.json; point it at a model folder")
        if self.draft_path is not None and not (self.draft_path / "config.json").is_file():
            raise ValueError(f"--draft {self.draft_path} has no config.json; point it at a model folder or pass --no-draft")
        if not 0 <= self.default_gamma <= self.gamma_max:
            raise ValueError(f"default_gamma must be 0..gamma_max={self.gamma_max}, got {self.default_gamma}")
        if self.heartbeat_ttl_s < 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must be at least twice heartbeat_interval_s, or one late beat kills the worker")
        for name in ("heartbeat_interval_s", "policy_ttl_s", "cancel_poll_s", "output_ttl_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_running", "stats_maxlen", "read_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def use_engine_process(self) -> bool:
        return self.device.startswith("cuda") if self.engine_process is None else self.engine_process

    @property
    def model_name(self) -> str:
        """What heartbeats and the metrics' model_name label say: the gateway's name for it."""
        return self.served_model_name or self.target_path.name

    def engine_config(self):
        from worker.engine.config import EngineConfig

        extra = {"kv_budget_bytes": self.kv_budget_bytes} if self.kv_budget_bytes else {}
        return EngineConfig(
            target_path=str(self.target_path), draft_path=str(self.draft_path) if self.draft_path else None,
            device=self.device, dtype=self.dtype, max_running=self.max_running, gamma_max=self.gamma_max,
            default_gamma=self.default_gamma if self.draft_path else 0, num_threads=self.num_threads,
            max_model_len=self.max_model_len, **extra,
        )
