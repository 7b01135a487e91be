"""``nightjar serve``: gateway, scheduler, planner and N workers on this machine.

Starts the embedded redis-server unless --redis-url is given, waits until the gateway's gRPC
health is SERVING (a worker heartbeats), and stops everything on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from nightjar import paths
from nightjar.service_util import env_defaults
from nightjar.stack import Stack, StackConfig


def add_stack_args(p: argparse.ArgumentParser, *, port: int) -> None:
    env = env_defaults()
    p.add_argument("--port", type=int, default=port, help="gateway port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="gateway interface (0.0.0.0 = all)")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one (env NIGHTJAR_REDIS_URL is not used here)")
    p.add_argument("--key-prefix", default=env.key_prefix)
    p.add_argument("--policy", default="nightjar", help="nightjar | off | fixed:γ | threshold:B | table:... | ucb | heuristic | ema")
    p.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET, help="target model folder")
    p.add_argument("--draft", type=Path, default=paths.DEFAULT_DRAFT, help="draft model folder")
    p.add_argument("--no-draft", action="store_true", help="serve without a draft model (no speculation)")
    p.add_argument("--no-planner", action="store_true", help="run no planner (workers keep their default γ)")
    p.add_argument("--device", default="cpu", help="the workers' device: cpu or cuda[:N] (on CUDA each worker runs its "
                   "engine loop in a child process)")
    p.add_argument("--dtype", default="float32", help="the workers' weights and KV cache: float32, bfloat16, float16")
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: (cores - 1) / workers, at least 1)")
    p.add_argument("--io-nice", type=int, default=StackConfig.io_nice,
                   help="niceness added to every service but the workers (default 0: equal priority; see docs/pipeline.md)")
    p.add_argument("--log-dir", type=Path, default=None, help="write each service's log here (default: a temp folder)")
    p.add_argument("--log-level", default=env.log_level)
    p.add_argument("--metrics-port", type=int, default=env.metrics_port,
                   help="Prometheus /metrics of the gateway on this port, the scheduler on +1, the planner on +2, "
                        "worker i on +3+i (0 = off; env NIGHTJAR_METRICS_PORT)")


def stack_config(a: argparse.Namespace, p: argparse.ArgumentParser, **overrides) -> StackConfig:
    # the workers would refuse these too, but only after the stack started: say it here, naming the flag
    if not (a.device == "cpu" or a.device.startswith("cuda")):
        p.error(f"--device {a.device!r}: use cpu or cuda[:N]")
    if a.dtype not in ("float32", "bfloat16", "float16"):
        p.error(f"--dtype {a.dtype!r}: use float32, bfloat16 or float16")
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {a.device}: torch sees no CUDA device on this machine")
    fields = dict(port=a.port, host=a.host, workers=a.workers, redis_url=a.redis_url, key_prefix=a.key_prefix,
                  policy=a.policy, planner=not a.no_planner, target_path=a.target,
                  draft_path=None if a.no_draft else a.draft, worker_threads=a.worker_threads,
                  io_nice=a.io_nice, log_dir=a.log_dir, log_level=a.log_level, metrics_port=a.metrics_port,
                  worker_args=("--device", a.device, "--dtype", a.dtype))
    try:
        return StackConfig(**{**fields, **overrides})
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nightjar serve", description="run the whole Nightjar stack on this machine")
    add_stack_args(p, port=50051)
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = stack_config(a, p, log_dir=a.log_dir or Path(".nightjar/logs"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"nightjar: starting {cfg.workers} worker(s), policy {cfg.policy}; logs in {cfg.log_dir}", file=sys.stderr)
    stack = Stack(cfg)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"nightjar: the stack did not start: {exc}", file=sys.stderr)
        return 1
    redis_note = "embedded Redis" if cfg.redis_url is None else cfg.redis_url
    print(f"nightjar: ready on {stack.address} ({redis_note} at {stack.redis_url}); Ctrl-C stops", file=sys.stderr)
    if cfg.metrics_port:
        ports = ", ".join(f"{svc.name} :{svc.metrics_port}" for svc in stack.services)
        print(f"nightjar: /metrics on {ports}", file=sys.stderr)
    try:
        while not stop.wait(1.0):
            for svc in stack.services:
                if svc.proc and svc.proc.poll() is not None and not getattr(svc, "_reported", False):
                    svc._reported = True  # type: ignore[attr-defined]
                    print(f"nightjar: {svc.name} exited with {svc.proc.returncode}; see {svc.log_path}", file=sys.stderr)
    finally:
        print("nightjar: stopping", file=sys.stderr)
        stack.stop()
        print("nightjar: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
