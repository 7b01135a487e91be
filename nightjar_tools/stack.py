"""Stack: the whole Nightjar service set on one machine, as child processes.

Used by ``nightjar serve``, ``nightjar demo``, the pipeline tests and the pipeline benchmark.
Every service is its own process (``python -m nightjar_tools.cli <service> ...``), so a test can
SIGKILL one worker and watch the rest recover. Redis is the embedded redis-server unless a
URL is given; the embedded one gets a random password. Secrets (the Redis URL, which holds
the password, and the gateway's token) reach the services in their environment, never on
their command lines, which every local user can read (/proc/PID/cmdline, ``ps``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nightjar import paths
from nightjar.service_util import check_redis_url, connect_redis_sync
from nightjar_tools.redis_server import EmbeddedRedis, free_port

SERVICES = ("scheduler", "planner", "worker", "gateway")


@dataclass(frozen=True)
class StackConfig:
    port: int = 50051  # gateway port; 0 = pick a free one
    host: str = "127.0.0.1"
    workers: int = 1
    redis_url: str | None = None  # None = start the embedded redis-server
    key_prefix: str = "nj"
    policy: str = "nightjar"  # handed to the planner: nightjar | off | fixed:γ | threshold:B | table:... | ucb | heuristic | ema
    planner: bool = True  # False: no planner (workers keep their default γ)
    target_path: Path = paths.DEFAULT_TARGET
    draft_path: Path | None = paths.DEFAULT_DRAFT  # None = no speculation
    worker_threads: int | None = None  # torch threads per worker; None = (cores - 1) / workers
    gateway_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    planner_args: tuple[str, ...] = ()
    prior_surface: Path | None = None  # the planner's --prior-surface (nightjar's warm start); None: learn from nothing
    log_dir: Path | None = None  # None = a temporary folder (logs shown when a service fails)
    log_level: str = "INFO"
    log_format: str = "text"  # every service's --log-format
    ready_timeout_s: float = 180.0
    # Niceness added to every service but the workers (and to the embedded Redis), so that on
    # one machine the kernel does not time-slice the engine thread with the I/O services. Off
    # by default: its effect on the pipeline benchmark was within the noise (BENCHMARKS.md,
    # "Figures that were code comments"), and with as many workers as cores a nicer gateway,
    # which every token passes through, would be the one starved.
    io_nice: int = 0
    # Prometheus /metrics: 0 = off; else the gateway serves it on this port and every other
    # service on its own port after it (metrics_port_of): one endpoint per process, as
    # Prometheus scrapes several processes, and each worker's series told apart by its port.
    metrics_port: int = 0
    http_port: int | None = None  # the gateway's OpenAI HTTP API: None = off, 0 = a free port
    # Pass-through limits (nightjar serve's vLLM-shaped flags); None = the services' defaults.
    context_tokens: int | None = None  # the served context (nightjar_tools.model_check): gateway limit and worker max_model_len
    max_num_seqs: int | None = None  # sequences a worker decodes together
    kv_cache_bytes: int | None = None  # each worker's KV cache budget
    gamma_max: int | None = None  # deepest speculation a policy may choose
    served_model_name: str = ""  # what clients see; "" = the target folder's name
    chat_template: Path | None = None
    # Bearer token the gateway requires ("" = auth off). A secret: handed to the gateway in its
    # environment (NIGHTJAR_AUTH_TOKEN), never on a command line that `ps` shows.
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not 0 <= self.io_nice <= 19:
            raise ValueError(f"io_nice must be 0..19, got {self.io_nice}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port}")
        if self.metrics_port and not 0 < self.metrics_port <= 65535 - len(METRICS_OFFSETS) - self.workers:
            raise ValueError(f"--metrics-port must leave room for one port per service, got {self.metrics_port}")
        if self.redis_url is not None:
            try:
                check_redis_url(self.redis_url, self.key_prefix)
            except ValueError as exc:
                raise ValueError(f"--redis-url: {exc}") from None
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be 0..65535, got {self.http_port}")
        if not (self.target_path / "config.json").is_file():
            raise ValueError(f"--target {self.target_path} is not a model folder (no config.json)")
        if self.prior_surface is not None and not Path(self.prior_surface).is_file():
            raise ValueError(f"--prior-surface {self.prior_surface}: no such file")
        if self.draft_path is not None and not (self.draft_path / "config.json").is_file():
            raise ValueError(f"--draft {self.draft_path} is not a model folder (no config.json); or pass --no-draft")

    @property
    def default_gamma(self) -> int:
        """γ the workers use while no planner policy is in force: the policy's own when it is fixed."""
        if self.draft_path is None or self.policy == "off":
            return 0
        if self.policy.startswith("fixed:"):
            return int(self.policy.split(":", 1)[1])
        return 0


METRICS_OFFSETS = {"gateway": 0, "scheduler": 1, "planner": 2, "worker": 3}


def metrics_port_of(base: int, service: str, index: int = 0) -> int:
    """The /metrics port of a stack's service: base + 0 gateway, + 1 scheduler, + 2 planner,
    + 3 + i the i-th worker."""
    return base + METRICS_OFFSETS[service] + (index if service == "worker" else 0)


@dataclass
class Service:
    name: str
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    metrics_port: int = 0  # its /metrics port (0 = none)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # its environment: holds the secrets

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the service's process and its children (a worker on CUDA runs its
        engine in a child process), from /proc (Linux)."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:  # exited meanwhile
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        return total

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class Stack:
    cfg: StackConfig
    redis: EmbeddedRedis | None = None
    redis_url: str = ""
    port: int = 0
    http_port: int = 0  # 0 = no HTTP API
    services: list[Service] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory | None = None
    _abort: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ lifecycle

    def abort_start(self) -> None:
        """Make a ``start`` running in another thread give up and stop what it started."""
        self._abort.set()

    def start(self) -> "Stack":
        cfg = self.cfg
        if cfg.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="nightjar-stack-")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.redis_url is None:
            self.redis = EmbeddedRedis(password=secrets.token_hex(16), launcher=tuple(niced(cfg.io_nice))).start()
            self.redis_url = self.redis.url
        else:
            self.redis_url = cfg.redis_url
        self.port = cfg.port or free_port()
        try:
            self._spawn("scheduler", list(cfg.scheduler_args))
            if cfg.planner and _planner_available():
                self._spawn("planner", self._planner_args())
            for _ in range(cfg.workers):
                self.add_worker()
            gw = ["--host", cfg.host, "--port", str(self.port), "--target", str(cfg.target_path)]
            gw += ["--draft", str(cfg.draft_path)] if cfg.draft_path else ["--no-draft"]
            gw += self._gateway_limits()
            if cfg.http_port is None:
                gw += ["--no-http"]
            else:
                self.http_port = cfg.http_port or free_port()
                gw += ["--http-port", str(self.http_port)]
            self._spawn("gateway", gw + list(cfg.gateway_args))
            self.wait_ready(cfg.ready_timeout_s, workers=cfg.workers)
        except BaseException:
            self.stop()
            raise
        return self

    def _planner_args(self) -> list[str]:
        cfg = self.cfg
        gamma = ["--gamma-max", str(cfg.gamma_max)] if cfg.gamma_max is not None else []
        prior = ["--prior-surface", str(cfg.prior_surface)] if cfg.prior_surface is not None else []
        return ["--policy", cfg.policy, *gamma, *prior, *cfg.planner_args]

    def _gateway_limits(self) -> list[str]:
        cfg, out = self.cfg, []
        if cfg.context_tokens:
            limit = cfg.context_tokens - 1  # room for one prompt token
            out += ["--max-context-tokens", str(cfg.context_tokens), "--max-tokens-limit", str(limit),
                    "--default-max-tokens", str(min(64, limit))]
        if cfg.gamma_max is not None:
            out += ["--gamma-max", str(cfg.gamma_max)]
        if cfg.served_model_name:
            out += ["--served-model-name", cfg.served_model_name]
        if cfg.chat_template is not None:
            out += ["--chat-template", str(cfg.chat_template)]
        return out

    def _worker_limits(self) -> list[str]:
        cfg, out = self.cfg, []
        for flag, value in (("--max-model-len", cfg.context_tokens), ("--max-running", cfg.max_num_seqs),
                            ("--kv-budget-bytes", cfg.kv_cache_bytes), ("--gamma-max", cfg.gamma_max)):
            if value is not None:
                out += [flag, str(value)]
        if cfg.served_model_name:  # the same model_name label on the workers' metrics as the gateway's
            out += ["--served-model-name", cfg.served_model_name]
        return out

    @property
    def log_dir(self) -> Path:
        return Path(self._tmp.name) if self._tmp else Path(self.cfg.log_dir)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI API (…/v1), or "" when it is off."""
        return f"http://{self.cfg.host}:{self.http_port}/v1" if self.http_port else ""

    def add_worker(self, extra: list[str] | None = None) -> Service:
        cfg = self.cfg
        # One core stays with the gateway, scheduler and planner: a torch thread pool that
        # competes with them for every core spins and runs several times slower.
        threads = cfg.worker_threads or max(1, ((os.cpu_count() or 1) - 1) // cfg.workers)
        args = ["--target", str(cfg.target_path), "--threads", str(threads), "--default-gamma", str(cfg.default_gamma)]
        args += ["--draft", str(cfg.draft_path)] if cfg.draft_path else ["--no-draft"]
        return self._spawn("worker", args + self._worker_limits() + list(cfg.worker_args) + list(extra or ()))

    def workers(self) -> list[Service]:
        return [s for s in self.services if s.name == "worker"]

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def _spawn(self, name: str, args: list[str]) -> Service:
        n = sum(s.name == name for s in self.services)
        log_path = self.log_dir / f"{name}-{n}.log"
        full = [*args, "--key-prefix", self.cfg.key_prefix, "--log-level", self.cfg.log_level,
                "--log-format", self.cfg.log_format, "--metrics-host", self.cfg.host]
        metrics_port = metrics_port_of(self.cfg.metrics_port, name, n) if self.cfg.metrics_port else 0
        if metrics_port:
            full += ["--metrics-port", str(metrics_port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "NIGHTJAR_REDIS_URL": self.redis_url}  # the password is in the URL: environment, not argv
        env.pop("NIGHTJAR_METRICS_PORT", None)  # the same port for every service would stop all but one
        if name == "gateway" and self.cfg.api_key:
            env["NIGHTJAR_AUTH_TOKEN"] = self.cfg.api_key
        svc = Service(name, full, log_path, None, metrics_port, env)
        self.relaunch(svc)
        self.services.append(svc)
        return svc

    def relaunch(self, svc: Service) -> None:
        """Start ``svc``'s process (again: its log is appended to, its arguments and environment kept)."""
        with open(svc.log_path, "ab") as log:
            svc.proc = subprocess.Popen([*niced(0 if svc.name == "worker" else self.cfg.io_nice), sys.executable, "-m",
                                         "nightjar_tools.cli", svc.name, *svc.args],
                                        stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=svc.env, cwd=str(paths.ROOT))

    def wait_ready(self, timeout_s: float, workers: int = 1) -> None:
        """Until the gateway's health is SERVING and ``workers`` workers heartbeat."""
        import grpc
        import redis
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from nightjar.keys import Keys

        keys = Keys(self.cfg.key_prefix)
        deadline = time.monotonic() + timeout_s
        client = connect_redis_sync(self.redis_url, socket_connect_timeout=1, socket_timeout=2)
        with contextlib.closing(client), grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self._abort.is_set():
                    raise RuntimeError("the stack's start was aborted")
                for svc in self.services:
                    if not svc.alive() and svc.proc.returncode not in (None, -signal.SIGKILL):
                        raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} while starting; its log:\n{svc.log_tail()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    live = sum(client.exists(keys.heartbeat(w.decode())) for w in client.smembers(keys.workers))
                    if status == health_pb2.HealthCheckResponse.SERVING and live >= workers:
                        return
                except (grpc.RpcError, redis.RedisError):
                    pass
                if time.monotonic() > deadline:
                    tails = "\n".join(f"--- {s.name}\n{s.log_tail(15)}" for s in self.services)
                    raise TimeoutError(f"the stack was not ready within {timeout_s:.0f}s; logs:\n{tails}")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the gateway first (it drains), then the rest; SIGKILL whatever lingers."""
        order = sorted(self.services, key=lambda s: {"gateway": 0, "worker": 1, "scheduler": 2, "planner": 3}[s.name])
        for group in (("gateway",), ("worker", "scheduler", "planner")):
            procs = [s.proc for s in order if s.name in group and s.alive()]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_stops_stacks() -> Iterator[None]:
    """Within it, SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so every running Stack's stop
    runs on the way out (asyncio.run cancels what is left). Python's default SIGTERM action exits
    at once and leaves the stack's processes behind. Not by re-sending SIGINT: a process started
    in the background ignores it. Signal handlers belong to the main thread; elsewhere this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _planner_available() -> bool:
    return (paths.ROOT / "planner_svc" / "__main__.py").is_file()


def niced(increment: int) -> list[str]:
    """The command prefix that starts a process ``increment`` nicer (coreutils ``nice``), or
    nothing where there is no ``nice``: the priority is a tuning, never a requirement."""
    tool = shutil.which("nice") if increment else None
    return [tool, "-n", str(increment)] if tool else []
