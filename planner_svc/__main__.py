"""``nightjar planner``: run the planner alone."""

from __future__ import annotations

import argparse
import sys

from nightjar.paths import cost_surface
from nightjar.service_util import add_common_args, env_defaults, run_redis_loop, service_main
from planner_svc.config import PlannerConfig
from planner_svc.policies import SPECS


def parse_config(argv: list[str]) -> PlannerConfig:
    env = env_defaults()
    p = argparse.ArgumentParser(prog="nightjar planner", description="learn γ per batch size and draft residency")
    p.add_argument("--policy", default="nightjar", help=f"one of: {', '.join(SPECS)}")
    p.add_argument("--gamma-max", type=int, default=PlannerConfig.gamma_max, help="largest speculation depth γ (<= the workers')")
    p.add_argument("--ttl-s", type=float, default=10.0, help="workers fall back to their default γ after this")
    p.add_argument("--seed", type=int, default=0, help="seed of the policy's exploration")
    p.add_argument("--buckets", default=",".join(map(str, PlannerConfig().buckets)),
                   help="batch-size bucket upper bounds, ascending, comma-separated")
    p.add_argument("--consumer", default=None, help="consumer name in the stats group (default: unique per process)")
    p.add_argument("--prior-surface", default="none",
                   help="warm-start nightjar from an offline cost surface of the served models: a JSON file of "
                        "scripts/bench_speculation.py, or a shipped one by name (cpu_serve, cpu_serve_zen4, cpu_tiny, ...: "
                        "the shipped pairs on CPU in float32), or auto:serve / auto:tiny (that pair's surface "
                        "measured on this kind of CPU); another machine's is rescaled by the first live steps. "
                        "none (default): learn online from nothing")
    add_common_args(p, env)
    a = p.parse_args(argv)
    extra = {"consumer": a.consumer} if a.consumer else {}
    try:
        buckets = tuple(int(x) for x in a.buckets.split(",") if x.strip())
        prior = cost_surface(a.prior_surface)
        return PlannerConfig(redis_url=a.redis_url, key_prefix=a.key_prefix, policy=a.policy, gamma_max=a.gamma_max,
                             ttl_s=a.ttl_s, seed=a.seed, buckets=buckets, metrics_port=a.metrics_port,
                             metrics_host=a.metrics_host or "127.0.0.1",
                             log_level=a.log_level, log_format=a.log_format, prior_surface=prior and str(prior), **extra)
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: PlannerConfig) -> int:
    from planner_svc.service import PlannerService

    return await run_redis_loop("planner", cfg, lambda redis: PlannerService(cfg, redis))


def main(argv: list[str] | None = None) -> int:
    return service_main("planner", parse_config, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
