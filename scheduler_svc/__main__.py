"""``nightjar scheduler``: run the scheduler alone."""

from __future__ import annotations

import argparse
import sys

from nightjar.service_util import add_common_args, env_defaults, run_redis_loop, service_main
from scheduler_svc.config import SchedulerConfig


def parse_config(argv: list[str]) -> SchedulerConfig:
    env = env_defaults()
    p = argparse.ArgumentParser(prog="nightjar scheduler", description="dispatch queued requests to workers")
    p.add_argument("--consumer", default=None, help="consumer name in the requests group (default: unique per process)")
    p.add_argument("--max-deliveries", type=int, default=5, help="dead-letter a queue entry delivered more often")
    p.add_argument("--max-attempts", type=int, default=3, help="fail a request whose workers died this often")
    p.add_argument("--claim-idle-ms", type=int, default=10_000, help="reclaim entries a dead scheduler left pending this long")
    p.add_argument("--stall-s", type=float, default=SchedulerConfig.stall_s,
                   help="a worker with work whose engine takes no step this long is treated as dead")
    add_common_args(p, env)
    a = p.parse_args(argv)
    extra = {"consumer": a.consumer} if a.consumer else {}
    try:
        return SchedulerConfig(redis_url=a.redis_url, key_prefix=a.key_prefix, max_deliveries=a.max_deliveries,
                               max_attempts=a.max_attempts, claim_idle_ms=a.claim_idle_ms, stall_s=a.stall_s,
                               metrics_port=a.metrics_port, metrics_host=a.metrics_host or "127.0.0.1",
                               log_level=a.log_level, log_format=a.log_format, **extra)
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: SchedulerConfig) -> int:
    from scheduler_svc.dispatcher import Dispatcher

    return await run_redis_loop("scheduler", cfg, lambda redis: Dispatcher(cfg, redis))


def main(argv: list[str] | None = None) -> int:
    return service_main("scheduler", parse_config, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
