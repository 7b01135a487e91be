"""``nightjar worker``: run one worker (engine + its Redis service) alone."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from nightjar import paths
from nightjar.service_util import add_common_args, connect_redis, env_defaults, install_stop_handlers, service_main
from worker.service.config import EngineConfig, WorkerServiceConfig


def parse_config(argv: list[str]) -> WorkerServiceConfig:
    env = env_defaults()
    p = argparse.ArgumentParser(prog="nightjar worker", description="one inference worker")
    p.add_argument("--worker-id", default=None, help="unique id (default: host-pid-random)")
    p.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET, help="target model folder")
    p.add_argument("--draft", type=Path, default=paths.DEFAULT_DRAFT, help="draft model folder")
    p.add_argument("--no-draft", action="store_true", help="no draft model: plain decoding")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    p.add_argument("--prefill-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="CPU: run prompt tokens in bfloat16: matmuls, attention and the MLP between them (AMX; "
                        "several times faster, logits within bf16 rounding of float32's; the KV cache stays float32)")
    p.add_argument("--kv-budget-bytes", type=int, default=None, help="KV cache budget (default: the engine's)")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoded together at most")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion cap (default: the models' own)")
    p.add_argument("--gamma-max", type=int, default=6)
    p.add_argument("--default-gamma", type=int, default=0, help="γ while no fresh planner policy is known")
    p.add_argument("--policy-ttl-s", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--drain-grace-s", type=float, default=WorkerServiceConfig.drain_grace_s,
                   help="SIGTERM: let running requests finish for this long (compose's stop_grace_period must cover it)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine loop in a child process (default: on CUDA yes, on the CPU a thread)")
    p.add_argument("--served-model-name", default="",
                   help="the model's name in heartbeats and the metrics' model_name label, as the gateway's "
                        "(default: the target folder's name)")
    add_common_args(p, env)
    a = p.parse_args(argv)
    extra = {"worker_id": a.worker_id} if a.worker_id else {}
    kv = {"kv_budget_bytes": a.kv_budget_bytes} if a.kv_budget_bytes else {}
    draft = None if a.no_draft else a.draft
    try:
        engine = EngineConfig(
            target_path=str(a.target), draft_path=str(draft) if draft else None, device=a.device, dtype=a.dtype,
            prefill_dtype=a.prefill_dtype, max_running=a.max_running, max_model_len=a.max_model_len, gamma_max=a.gamma_max,
            default_gamma=a.default_gamma if draft else 0, num_threads=a.threads, **kv)
        return WorkerServiceConfig(
            redis_url=a.redis_url, key_prefix=a.key_prefix, engine=engine, policy_ttl_s=a.policy_ttl_s,
            engine_process=a.engine_process, drain_grace_s=a.drain_grace_s,
            metrics_port=a.metrics_port, metrics_host=a.metrics_host or "127.0.0.1", log_level=a.log_level, log_format=a.log_format,
            served_model_name=a.served_model_name, **extra)
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: WorkerServiceConfig) -> int:
    from nightjar import metrics
    from worker.service.loops import WorkerService

    metrics.use("worker", cfg.model_name)
    metrics.serve(cfg.metrics_port, cfg.metrics_host)
    redis = connect_redis(cfg.redis_url, block_margin_s=6.0)
    stop = asyncio.Event()
    install_stop_handlers(asyncio.get_running_loop(), lambda _sig: stop.set())
    try:
        await WorkerService(cfg, redis).run(stop)
    finally:
        await redis.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    return service_main(lambda cfg: f"worker[{cfg.worker_id}]", parse_config, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
