"""The gateway's one frozen, validated configuration (built in ``gateway.__main__``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nightjar import paths
from nightjar.dispatch_lease import ASSIGNMENT_TTL_S
from nightjar.service_util import check_redis_url


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"  # "0.0.0.0" to listen on every interface (compose does)
    port: int = 50051  # 0 = pick a free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "nj"
    target_path: Path = paths.DEFAULT_TARGET  # tokenizer + model limits come from this folder
    draft_path: Path | None = paths.DEFAULT_DRAFT  # only named in GetModelInfo
    default_max_tokens: int = 64  # used when a request leaves max_tokens at 0
    max_tokens_limit: int = 1024  # largest max_tokens accepted
    gamma_max: int = 6  # reported by GetModelInfo
    max_streams: int = 1024  # concurrent Generate streams on this gateway
    max_queued: int = 256  # requests admitted but without a first token yet (+ undispatched backlog)
    retry_after_ms: int = 200  # hint sent with RESOURCE_EXHAUSTED
    auth_token: str = ""  # bearer token clients must send; empty = auth off
    drain_grace_s: float = 10.0  # SIGTERM: how long running streams may finish
    output_ttl_s: float = 600.0  # an output stream left behind expires after this
    cancel_ttl_s: float = 600.0  # a cancel marker lives this long (covers re-dispatch)
    redis_timeout_s: float = 1.0  # connect timeout: UNAVAILABLE comes this fast when Redis is down
    read_block_ms: int = 1000  # XREAD BLOCK per call while following an output stream
    # Streams in flight wait out Redis errors this long (a restart with AOF, a failover), within
    # their own deadlines; a Redis that comes back without its data fails them at once.
    redis_outage_s: float = 10.0
    health_interval_s: float = 0.25  # how often Redis and worker liveness are polled
    require_worker: bool = True  # health is SERVING only once a worker heartbeats
    direct_dispatch: bool = True  # put jobs into a worker's inbox under the scheduler's lease (nightjar.dispatch_lease)
    assignment_ttl_s: float = ASSIGNMENT_TTL_S  # as the scheduler's, for the jobs dispatched directly
    http_port: int | None = None  # OpenAI-compatible HTTP API on this port (0 = any free one); None = off
    served_model_name: str = ""  # "" = the target folder's name (nightjar serve passes MODEL as given)
    chat_template: Path | None = None  # Jinja file for /v1/chat/completions; None = the tokenizer's own
    tokenizer_workers: int = 2  # threads that tokenize prompts (off the event loop)
    context_tokens: int = 0  # the engine's real context (nightjar serve computes it); 0 = the checkpoints' own
    metrics_port: int = 0
    metrics_host: str = ""  # /metrics interface; "" = where the gateway listens (``host``)
    log_level: str = "INFO"
    log_format: str = "text"  # nightjar.service_util.LOG_FORMATS

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url, self.key_prefix)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port}")
        if not (self.target_path / "tokenizer.json").exists() and not (self.target_path / "tokenizer_config.json").exists():
            raise ValueError(f"--target {self.target_path} has no tokenizer (tokenizer.json); point it at a model folder")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be 0..65535, got {self.http_port}")
        if self.chat_template is not None and not self.chat_template.is_file():
            raise ValueError(f"--chat-template {self.chat_template} is not a file")
        if self.context_tokens < 0:
            raise ValueError(f"--max-context-tokens must be >= 0 (0 = from the checkpoints), got {self.context_tokens}")
        for name in ("default_max_tokens", "max_tokens_limit", "max_streams", "max_queued", "read_block_ms",
                     "tokenizer_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        for name in ("drain_grace_s", "output_ttl_s", "cancel_ttl_s", "redis_timeout_s", "health_interval_s",
                     "assignment_ttl_s", "redis_outage_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError(f"key_prefix must be non-empty and contain no ':', got {self.key_prefix!r}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name clients see (GetModelInfo, /v1/models, the OpenAI 'model' field)."""
        return self.served_model_name or self.target_path.name

    @property
    def draft_name(self) -> str:
        return self.draft_path.name if self.draft_path else ""

    @property
    def max_context_tokens(self) -> int:
        """``context_tokens`` when given, else the smaller max_position_embeddings of target and draft."""
        if self.context_tokens:
            return self.context_tokens
        folders = [self.target_path] + ([self.draft_path] if self.draft_path else [])
        configs = [folder / "config.json" for folder in folders]
        return min(int(json.loads(c.read_text()).get("max_position_embeddings", 2048)) for c in configs if c.is_file())
