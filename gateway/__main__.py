"""``nightjar gateway``: run the gRPC gateway alone."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gateway.config import GatewayConfig
from nightjar import paths
from nightjar.service_util import add_common_args, env_defaults, install_stop_handlers, service_main


def parse_config(argv: list[str]) -> GatewayConfig:
    env = env_defaults()
    p = argparse.ArgumentParser(prog="nightjar gateway", description="gRPC and OpenAI-compatible HTTP front door of a Nightjar stack")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET, help="target model folder (tokenizer, limits)")
    p.add_argument("--draft", type=Path, default=paths.DEFAULT_DRAFT, help="draft model folder (named in GetModelInfo)")
    p.add_argument("--no-draft", action="store_true", help="report no draft model")
    p.add_argument("--max-queued", type=int, default=256, help="requests waiting for a first token before RESOURCE_EXHAUSTED")
    p.add_argument("--max-streams", type=int, default=1024, help="concurrent streams on this gateway")
    p.add_argument("--max-tokens-limit", type=int, default=1024)
    p.add_argument("--default-max-tokens", type=int, default=64)
    p.add_argument("--drain-grace-s", type=float, default=10.0, help="SIGTERM: how long running streams may finish")
    p.add_argument("--redis-outage-s", type=float, default=GatewayConfig.redis_outage_s,
                   help="streams in flight wait out Redis errors this long (restart with AOF, failover) before UNAVAILABLE")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API on this port, same interface as gRPC (0 = any free port)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="Jinja chat template for /v1/chat/completions (default: the tokenizer's own)")
    p.add_argument("--served-model-name", default="", help="model name clients see (default: the target folder's name)")
    p.add_argument("--max-context-tokens", type=int, default=0,
                   help="the engine's real context (nightjar serve computes it; 0 = the checkpoints' own)")
    p.add_argument("--gamma-max", type=int, default=6, help="reported by GetModelInfo")
    p.add_argument("--tokenizer-workers", type=int, default=2, help="threads that tokenize prompts off the event loop")
    p.add_argument("--auth-token", default=env.auth_token, help="require 'authorization: Bearer TOKEN'; prefer env NIGHTJAR_AUTH_TOKEN, a command "
                        "line is visible to every local user")
    p.add_argument("--no-require-worker", action="store_true", help="report SERVING even before a worker heartbeats")
    p.add_argument("--no-direct-dispatch", action="store_true",
                   help="send every job through the scheduler instead of into a leased worker's inbox")
    add_common_args(p, env)
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            host=a.host, port=a.port, redis_url=a.redis_url, key_prefix=a.key_prefix, target_path=a.target,
            draft_path=None if a.no_draft else a.draft, max_queued=a.max_queued, max_streams=a.max_streams,
            max_tokens_limit=a.max_tokens_limit, default_max_tokens=a.default_max_tokens,
            drain_grace_s=a.drain_grace_s, redis_outage_s=a.redis_outage_s, auth_token=a.auth_token, require_worker=not a.no_require_worker,
            direct_dispatch=not a.no_direct_dispatch, http_port=None if a.no_http else a.http_port,
            chat_template=a.chat_template, served_model_name=a.served_model_name, context_tokens=a.max_context_tokens,
            gamma_max=a.gamma_max, tokenizer_workers=a.tokenizer_workers,
            metrics_port=a.metrics_port, metrics_host=a.metrics_host or a.host, log_level=a.log_level, log_format=a.log_format,
        )
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: GatewayConfig) -> int:
    from gateway.server import Gateway
    from nightjar import metrics

    metrics.use("gateway", cfg.model_name)
    metrics.serve(cfg.metrics_port, cfg.metrics_host or cfg.host)
    gw = Gateway(cfg)
    await gw.start()
    stop = asyncio.Event()
    install_stop_handlers(asyncio.get_running_loop(), lambda _sig: stop.set())
    await stop.wait()
    await gw.drain_and_stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return service_main("gateway", parse_config, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
