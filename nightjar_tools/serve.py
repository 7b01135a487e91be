"""``nightjar serve [MODEL]``: gateway (gRPC + OpenAI HTTP), scheduler, planner and N workers on
this machine, with vLLM's command shape (README "Using it" lists every difference).

MODEL is a checkpoint folder or a hub id already in the local Hugging Face cache; without
``--draft`` there is no speculation. Only when MODEL is omitted is the shipped pair served.
Every check (model type, shared tokenizer, limits, the real context) runs before anything
starts. Starts the embedded redis-server unless --redis-url is given, waits until the gateway's
gRPC health is SERVING (a worker heartbeats), and stops everything on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from nightjar import paths
from nightjar.service_util import env_defaults, masked
from planner_svc.config import PlannerConfig
from nightjar_tools.model_check import check
from nightjar_tools.model_ref import resolve
from nightjar_tools.stack import Stack, StackConfig
from nightjar_tools.supervisor import Supervisor


def add_stack_args(p: argparse.ArgumentParser, *, port: int, http_port: int | None = None) -> None:
    env = env_defaults()
    p.add_argument("--port", type=int, default=port, help="gateway gRPC port (0 = any free port)")
    if http_port is not None:
        p.add_argument("--http-port", type=int, default=http_port,
                       help="OpenAI-compatible HTTP API port, on the --host interface (0 = any free port)")
        p.add_argument("--no-http", action="store_true", help="serve gRPC only")
        p.add_argument("--chat-template", type=Path, default=None,
                       help="Jinja chat template for /v1/chat/completions (default: the checkpoint's own)")
        p.add_argument("--served-model-name", default=None, help="model name clients see (default: MODEL as given)")
    p.add_argument("--host", default="127.0.0.1", help="gateway interface (0.0.0.0 = all)")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one (env NIGHTJAR_REDIS_URL is not used here)")
    p.add_argument("--key-prefix", default=env.key_prefix)
    p.add_argument("--policy", default="nightjar", help="nightjar | off | fixed:γ | threshold:B | table:... | ucb | heuristic | ema")
    p.add_argument("--model", default=None, help="target checkpoint: a folder or a hub id in the local HF cache "
                   "(default: the shipped pair, target and draft)")
    p.add_argument("--target", default=None, help="deprecated alias of --model")
    p.add_argument("--draft", default=None, help="draft checkpoint (folder or cached hub id); without it, no speculation")
    p.add_argument("--no-draft", action="store_true", help="no draft even for the shipped pair")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion cap (default: the engine's real context, min of target, draft, KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences each worker decodes together")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="each worker's KV cache budget in bytes (default 256 MiB; vLLM's --gpu-memory-utilization has no equivalent)")
    p.add_argument("--gamma-max", type=int, default=PlannerConfig.gamma_max,
                   help="deepest speculation the policy may choose (planner, workers and gateway alike)")
    p.add_argument("--api-key", default=os.environ.get("NIGHTJAR_API_KEY", env.auth_token),
                   help="require 'Authorization: Bearer KEY' on gRPC and HTTP (env NIGHTJAR_API_KEY or "
                        "NIGHTJAR_AUTH_TOKEN; handed to the gateway in its environment, never its argv)")
    p.add_argument("--no-planner", action="store_true", help="run no planner (workers keep their default γ)")
    p.add_argument("--device", default="cpu", help="the workers' device: cpu or cuda[:N] (on CUDA each worker runs its "
                   "engine loop in a child process)")
    p.add_argument("--dtype", default="float32", help="the workers' weights and KV cache: float32, bfloat16, float16")
    p.add_argument("--prefill-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="CPU float32 workers: run prompt tokens in bfloat16: matmuls, attention and the MLP between "
                        "them (AMX; several times faster prefill, logits within bf16 rounding of float32's)")
    add_prior_surface_arg(p)
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: (cores - 1) / workers, at least 1)")
    p.add_argument("--io-nice", type=int, default=StackConfig.io_nice,
                   help="niceness added to every service but the workers (default 0: equal priority; see docs/pipeline.md)")
    p.add_argument("--log-dir", type=Path, default=None, help="write each service's log here (default: a temp folder)")
    p.add_argument("--log-level", default=env.log_level)
    p.add_argument("--log-format", choices=("text", "json"), default=env.log_format,
                   help="every service's log lines: text, or json (env NIGHTJAR_LOG_FORMAT)")
    p.add_argument("--metrics-port", type=int, default=env.metrics_port,
                   help="Prometheus /metrics of the gateway on this port, the scheduler on +1, the planner on +2, "
                        "worker i on +3+i (0 = off; env NIGHTJAR_METRICS_PORT)")


def fail(p: argparse.ArgumentParser, message: str) -> NoReturn:
    """One line on stderr, exit 2: what to change, without argparse's usage block."""
    print(f"{p.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve_models(a: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[Path, Path | None, str]:
    """(target folder, draft folder or None, the name clients see)."""
    model = getattr(a, "model_arg", None)
    if model is not None and a.model is not None and model != a.model:
        fail(p, f"MODEL {model} and --model {a.model} disagree; give one")
    model = model or a.model
    if a.target is not None:
        if model is not None:
            fail(p, "--target is the deprecated spelling of MODEL; give one of them")
        print(f"{p.prog}: warning: --target is deprecated; use MODEL (positional) or --model", file=sys.stderr)
        model = a.target
    try:
        if model is None:  # the shipped pair, and only here is a draft implied
            target = paths.DEFAULT_TARGET
            draft = None if a.no_draft else (resolve(a.draft, "--draft") if a.draft else paths.DEFAULT_DRAFT)
            return target, draft, target.name
        target = resolve(model)
        draft = resolve(a.draft, "--draft") if a.draft and not a.no_draft else None
    except ValueError as exc:
        fail(p, str(exc))
    return target, draft, model


def add_prior_surface_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prior-surface", default="auto",
                   help="warm-start nightjar from this offline cost surface (scripts/bench_speculation.py's JSON); "
                        "or a shipped one by name (cpu_serve, cpu_serve_zen4, cpu_tiny, ...); auto (default): the surface "
                        "shipped for the model on this kind of CPU, if one is (the shipped pairs on CPU in float32); "
                        "none: learn online from nothing")


def prior_surface(choice: str, target: Path, device: str = "cpu", dtype: str = "float32") -> Path | None:
    """--prior-surface: auto (the surface shipped for ``target`` on this device and CPU, if any), or what
    the planner's own flag takes (``paths.cost_surface``: none, a shipped surface's name, a file)."""
    if choice == "auto":
        return paths.shipped_surface(target, device, dtype)
    return paths.cost_surface(choice)


def stack_config(a: argparse.Namespace, p: argparse.ArgumentParser, **overrides) -> StackConfig:
    # the workers would refuse these too, but only after the stack started: say it here, naming the flag
    if not (a.device == "cpu" or a.device.startswith("cuda")):
        fail(p, f"--device {a.device!r}: use cpu or cuda[:N]")
    if a.dtype not in ("float32", "bfloat16", "float16"):
        fail(p, f"--dtype {a.dtype!r}: use float32, bfloat16 or float16")
    if a.prefill_dtype == "bfloat16":
        from worker.engine.linear import can_bf16_prefill

        if not can_bf16_prefill(a.device, a.dtype):
            fail(p, "--prefill-dtype bfloat16 is for --device cpu --dtype float32 on a CPU with AMX or AVX512-BF16")
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(p, f"--device {a.device}: torch sees no CUDA device on this machine")
    target, draft, name = resolve_models(a, p)
    prior = prior_surface(a.prior_surface, target, a.device, a.dtype)
    try:
        served = check(target, draft, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                       kv_cache_bytes=a.kv_cache_memory_bytes, gamma_max=a.gamma_max)
    except (ValueError, FileNotFoundError) as exc:
        fail(p, str(exc))
    http = getattr(a, "http_port", None)
    fields = dict(port=a.port, host=a.host, workers=a.workers, redis_url=a.redis_url, key_prefix=a.key_prefix,
                  policy=a.policy, planner=not a.no_planner, target_path=target, draft_path=draft,
                  worker_threads=a.worker_threads, io_nice=a.io_nice, log_dir=a.log_dir, log_level=a.log_level,
                  log_format=a.log_format,
                  metrics_port=a.metrics_port, worker_args=("--device", a.device, "--dtype", a.dtype)
                  + (("--prefill-dtype", a.prefill_dtype) if a.prefill_dtype != "float32" else ()),
                  http_port=None if http is None or a.no_http else http, api_key=a.api_key,
                  context_tokens=served.context_tokens, max_num_seqs=a.max_num_seqs,
                  kv_cache_bytes=a.kv_cache_memory_bytes, gamma_max=a.gamma_max,
                  served_model_name=getattr(a, "served_model_name", None) or (name if name != target.name else ""),
                  chat_template=getattr(a, "chat_template", None), prior_surface=prior)
    try:
        return StackConfig(**{**fields, **overrides})
    except ValueError as exc:
        fail(p, str(exc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nightjar serve", description="run the whole Nightjar stack on this machine")
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="target checkpoint: a folder or a hub id in the local HF cache (default: the shipped pair)")
    add_stack_args(p, port=50051, http_port=8000)
    from nightjar_tools.cli import version

    p.add_argument("--version", action="version", version=f"nightjar {version()}")
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
    redis_note = "embedded Redis, password-protected" if cfg.redis_url is None else "Redis"
    print(f"nightjar: ready on {stack.address} ({redis_note} at {masked(stack.redis_url)}); Ctrl-C stops", file=sys.stderr)
    if stack.http_url:
        print(f"nightjar: OpenAI API on {stack.http_url} (context {cfg.context_tokens} tokens)", file=sys.stderr)
    if cfg.metrics_port:
        ports = ", ".join(f"{svc.name} :{svc.metrics_port}" for svc in stack.services)
        print(f"nightjar: /metrics on {ports}", file=sys.stderr)
    supervisor = Supervisor(stack, log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        while not stop.wait(1.0):
            supervisor.tick()
    finally:
        print("nightjar: stopping", file=sys.stderr)
        stack.stop()
        print("nightjar: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
