"""Overload: offer far more requests than the stack can serve and check that it degrades cleanly.

    .venv/bin/python scripts/overload.py                 # 60 s at 10x the measured capacity
    .venv/bin/python scripts/overload.py --seconds 15 --factor 10 --max-queued 8

Starts its own stack (one worker), measures its capacity, then offers ``factor`` x that as an
open-loop Poisson load; what it reports: ``main``. tests/stack/test_overload.py runs the same
code for ~15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar import paths  # noqa: E402
from nightjar_tools.redis_server import free_port  # noqa: E402
from nightjar_tools.stack import Stack, StackConfig  # noqa: E402
from nightjar_client import NO_RETRY, AsyncClient  # noqa: E402
from nightjar_client import errors as sdk  # noqa: E402

PROMPTS = ["The history of the city begins", "Write a short note about rivers", "Once there was a small fox",
           "A good breakfast should have", "The engineer opened the manual and"]


@dataclass
class OverloadReport:
    offered: int = 0
    completed: int = 0  # admitted and finished with all their tokens
    refused: int = 0  # RESOURCE_EXHAUSTED
    refused_with_hint: int = 0  # ... carrying retry-after-ms
    failed: dict[str, int] = field(default_factory=dict)  # any other outcome (must stay empty)
    max_queued_seen: int = 0
    max_queued_cap: int = 0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    retry_after_s: float | None = None  # median hint
    duration_s: float = 0.0
    rss_mb: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # before, peak, after

    @property
    def lost(self) -> int:
        return sum(self.failed.values())


def gateway_waiting(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("nightjar_gateway_requests_queued"):
                return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError("the gateway does not export nightjar_gateway_requests_queued")


def rss_mb(stack: Stack) -> dict[str, float]:
    return {f"{s.name}-{s.proc.pid}": s.rss_bytes() / 2**20 for s in stack.services if s.alive()}


async def measure_capacity(stack: Stack, max_tokens: int, seconds: float = 8.0, concurrency: int = 16) -> float:
    """Requests per second a closed loop of ``concurrency`` clients completes."""
    done, stop_at = 0, time.monotonic() + seconds
    async with AsyncClient(stack.address) as c:
        async def loop(i: int) -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                await c.generate(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return done / (time.monotonic() - t0)


async def offer(stack: Stack, rps: float, seconds: float, max_tokens: int, metrics_port: int, max_queued: int,
                seed: int = 0) -> OverloadReport:
    """Open-loop Poisson arrivals at ``rps`` for ``seconds``; waits for every admitted request."""
    rep = OverloadReport(max_queued_cap=max_queued)
    rng = np.random.default_rng(seed)
    latencies: list[float] = []
    hints: list[float] = []
    before = rss_mb(stack)
    peak = dict(before)
    sampling = True

    async def sampler() -> None:
        while sampling:
            try:
                rep.max_queued_seen = max(rep.max_queued_seen, gateway_waiting(metrics_port))
            except OSError:
                pass
            for k, v in rss_mb(stack).items():
                peak[k] = max(peak.get(k, 0.0), v)
            await asyncio.sleep(0.1)

    async with AsyncClient(stack.address, retry=NO_RETRY) as c:
        async def one(prompt: str) -> None:
            t0 = time.monotonic()
            try:
                done = await c.generate(prompt, max_tokens=max_tokens, ignore_eos=True, deadline_s=300)
            except sdk.ResourceExhausted as exc:
                rep.refused += 1
                if exc.retry_after_s is not None and exc.retry_after_s > 0:
                    rep.refused_with_hint += 1
                    hints.append(exc.retry_after_s)
                return
            except sdk.NightjarError as exc:
                key = f"{type(exc).__name__}: {exc.details[:80]}"
                rep.failed[key] = rep.failed.get(key, 0) + 1
                return
            if done.finish_reason == "length" and len(done.token_ids) == max_tokens:
                rep.completed += 1
                latencies.append(time.monotonic() - t0)
            else:
                key = f"incomplete: {done.finish_reason} after {len(done.token_ids)} tokens"
                rep.failed[key] = rep.failed.get(key, 0) + 1

        sampler_task = asyncio.create_task(sampler())
        tasks, t0 = [], time.monotonic()
        next_at = t0
        while next_at < t0 + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one(PROMPTS[rep.offered % len(PROMPTS)] + f" ({uuid.uuid4().hex[:4]})")))
            rep.offered += 1
            next_at += float(rng.exponential(1.0 / rps))
        await asyncio.gather(*tasks)
        rep.duration_s = time.monotonic() - t0
        sampling = False
        await sampler_task
    after = rss_mb(stack)
    rep.rss_mb = {k: (round(before[k], 1), round(peak.get(k, before[k]), 1), round(after.get(k, 0.0), 1)) for k in before}
    if latencies:
        rep.latency_p50_s = float(np.percentile(latencies, 50))
        rep.latency_p99_s = float(np.percentile(latencies, 99))
    if hints:
        rep.retry_after_s = float(np.median(hints))
    return rep


def overload_stack(max_queued: int, metrics_port: int, **kw) -> Stack:
    kw.setdefault("worker_threads", None)
    cfg = StackConfig(port=0, workers=1, key_prefix=f"o{uuid.uuid4().hex[:8]}", policy="off", planner=False,
                      gateway_args=("--max-queued", str(max_queued), "--metrics-port", str(metrics_port)), **kw)
    return Stack(cfg).start()


def main(argv: list[str] | None = None) -> int:
    """Starts its own stack (one worker), measures capacity with a short closed loop, then offers an
    open-loop Poisson load of ``factor`` x capacity for ``seconds``. Reports: offered / admitted /
    refused (RESOURCE_EXHAUSTED, with the retry-after hint) / failed requests, whether every
    admitted request completed, the largest queue seen (gateway metric
    ``nightjar_gateway_requests_queued`` against ``--max-queued``), p50/p99 latency of admitted
    requests, and each service's memory before, at the peak and after."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long the overload lasts")
    p.add_argument("--factor", type=float, default=10.0, help="offered load as a multiple of measured capacity")
    p.add_argument("--max-queued", type=int, default=16, help="the gateway's queue cap")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    metrics_port = free_port()
    stack = overload_stack(a.max_queued, metrics_port, target_path=paths.DEFAULT_TARGET, draft_path=paths.DEFAULT_DRAFT)
    try:
        capacity = asyncio.run(measure_capacity(stack, a.max_tokens))
        rps = a.factor * capacity
        rep = asyncio.run(offer(stack, rps, a.seconds, a.max_tokens, metrics_port, a.max_queued))
    finally:
        stack.stop()
    if a.json:
        print(json.dumps({"capacity_rps": capacity, "offered_rps": rps, **asdict(rep), "lost": rep.lost}, indent=2))
    else:
        print(f"capacity {capacity:.1f} req/s; offered {rps:.1f} req/s ({a.factor:g}x) for {a.seconds:g} s")
        print(f"offered {rep.offered}  completed {rep.completed}  refused {rep.refused} "
              f"(with retry-after {rep.refused_with_hint}, median {rep.retry_after_s})  lost {rep.lost} {rep.failed}")
        print(f"queue: max waiting {rep.max_queued_seen} (cap {rep.max_queued_cap}); latency of admitted "
              f"p50 {rep.latency_p50_s:.2f} s, p99 {rep.latency_p99_s:.2f} s")
        for name, (b, pk, af) in sorted(rep.rss_mb.items()):
            print(f"  {name:<24} RSS before {b:7.1f} MB  peak {pk:7.1f} MB  after {af:7.1f} MB")
    return 0 if rep.lost == 0 and rep.max_queued_seen <= a.max_queued else 1


if __name__ == "__main__":
    sys.exit(main())
