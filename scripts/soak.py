"""Soak: replay the Azure conversation trace against a whole stack for N minutes and report
lost requests (goal 0), errors, and the memory growth of every service process (goal < 5%).

    .venv/bin/python scripts/soak.py --minutes 30            # the full soak
    .venv/bin/python scripts/soak.py --minutes 2 --json out.json   (tests/stack/test_soak.py runs this)

The load, what counts as lost and how memory growth is measured: ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar import paths  # noqa: E402
from nightjar_tools.bench.workload import LengthScale, PromptBank, build  # noqa: E402
from nightjar_tools.stack import Stack, StackConfig  # noqa: E402
from nightjar_client import AsyncClient  # noqa: E402
from nightjar_client import errors as sdk  # noqa: E402


@dataclass
class SoakReport:
    minutes: float
    capacity_rps: float = 0.0
    offered_rps: float = 0.0
    requests: int = 0
    ok: int = 0
    refused: int = 0
    lost: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    rss_mb: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> start, warm, end, growth_pct
    max_rss_growth_pct: float = 0.0
    redis_keys: tuple[int, int] = (0, 0)  # before, after
    redis_used_mb: tuple[float, float] = (0.0, 0.0)
    services_died: list[str] = field(default_factory=list)


def redis_view(stack: Stack) -> tuple[int, float]:
    import redis

    r = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    try:
        n = sum(1 for _ in r.scan_iter(match=f"{stack.cfg.key_prefix}:*", count=1000))
        return n, r.info("memory")["used_memory"] / 2**20
    finally:
        r.close()


async def capacity(stack: Stack, prompts: list[str], max_tokens: list[int], seconds: float, concurrency: int) -> float:
    """Completed requests per second of a closed loop over the trace's own length mix."""
    done, i, stop_at = 0, 0, time.monotonic() + seconds
    async with AsyncClient(stack.address) as c:
        async def loop() -> None:
            nonlocal done, i
            while time.monotonic() < stop_at:
                k, i = i % len(prompts), i + 1
                await c.generate(prompts[k], max_tokens=max_tokens[k], ignore_eos=True)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


async def replay(stack: Stack, arrivals: np.ndarray, prompts: list[str], max_tokens: list[int], rep: SoakReport,
                 sample_every_s: float, warmup_s: float) -> None:
    latencies: list[float] = []
    samples: dict[str, list[tuple[float, float]]] = {}
    running = True

    async def sampler(t0: float) -> None:
        while running:
            now = time.monotonic() - t0
            for s in stack.services:
                if s.alive():
                    samples.setdefault(f"{s.name}-{s.proc.pid}", []).append((now, s.rss_bytes() / 2**20))
            await asyncio.sleep(sample_every_s)

    async with AsyncClient(stack.address) as c:
        async def one(k: int) -> None:
            t = time.monotonic()
            try:
                done = await c.generate(prompts[k], max_tokens=max_tokens[k], ignore_eos=True, deadline_s=600)
            except sdk.ResourceExhausted:
                rep.refused += 1
                return
            except sdk.NightjarError as exc:
                rep.lost += 1
                key = f"{type(exc).__name__}: {exc.details[:100]}"
                rep.errors[key] = rep.errors.get(key, 0) + 1
                return
            if done.finish_reason == "length" and len(done.token_ids) == max_tokens[k]:
                rep.ok += 1
                rep.tokens += len(done.token_ids)
                latencies.append(time.monotonic() - t)
            else:
                rep.lost += 1
                key = f"incomplete ({done.finish_reason}, {len(done.token_ids)}/{max_tokens[k]} tokens)"
                rep.errors[key] = rep.errors.get(key, 0) + 1

        t0 = time.monotonic()
        sampler_task = asyncio.create_task(sampler(t0))
        tasks = []
        for k, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + float(at) - time.monotonic()))
            tasks.append(asyncio.create_task(one(k)))
        await asyncio.gather(*tasks)
        running = False
        await sampler_task
    rep.requests = len(tasks)
    if latencies:
        rep.e2e_p50_s, rep.e2e_p99_s = (round(float(np.percentile(latencies, q)), 3) for q in (50, 99))
    for name, series in samples.items():
        start = series[0][1]
        warm = next((v for t, v in series if t >= warmup_s), series[-1][1])
        end = series[-1][1]
        growth = 100.0 * (end - warm) / warm if warm else 0.0
        rep.rss_mb[name] = {"start": round(start, 1), "warm": round(warm, 1), "end": round(end, 1),
                            "growth_pct": round(growth, 2)}
    rep.max_rss_growth_pct = max((v["growth_pct"] for v in rep.rss_mb.values()), default=0.0)


def run(minutes: float, load: float, workers: int, warmup_frac: float, seed: int, log=print) -> SoakReport:
    """The trace (``nightjar.paths.TRACES_DIR``/AzureLLMInferenceTrace_conv.csv) keeps its own
    burstiness; its arrival times are scaled so the mean load is ``load`` x this machine's
    capacity (measured first with a short closed loop on the same length mix), and its lengths are
    scaled by ``nightjar_tools.bench.workload.LengthScale`` to fit the CPU models. Requests go through the
    SDK with its default retry policy, as a real client's would.

    Outcomes per request: ``ok`` (finished with every token asked for), ``refused`` (still
    RESOURCE_EXHAUSTED after the SDK's retries: load shedding, not loss), ``lost`` (anything else:
    an error, a missing final record, or a short completion). Memory: RSS of each service process
    sampled every few seconds; growth = last sample over the first sample after the warm-up (the
    first ``warmup_frac`` of the run, when allocators and caches fill), plus Redis's own
    used_memory and key count, which must come back to where they started."""
    duration_s = minutes * 60
    rep = SoakReport(minutes=minutes)
    cfg = StackConfig(port=0, workers=workers, key_prefix=f"soak{uuid.uuid4().hex[:6]}", policy="nightjar",
                      target_path=paths.DEFAULT_TARGET, draft_path=paths.DEFAULT_DRAFT)
    log(f"starting the stack ({workers} worker(s))")
    stack = Stack(cfg).start()
    try:
        bank = PromptBank()
        probe = build("azure_conv", 1.0, 600.0, seed=seed, scale=LengthScale(), max_requests=200, azure_load=1.0)
        probe_prompts = bank.texts(probe, seed=seed)
        rep.capacity_rps = asyncio.run(capacity(stack, probe_prompts, [int(x) for x in probe.output_tokens],
                                                seconds=min(20.0, max(8.0, duration_s / 10)), concurrency=8))
        keys0, used0 = redis_view(stack)
        wl = build("azure_conv", rep.capacity_rps, duration_s, seed=seed, scale=LengthScale(),
                   max_requests=1_000_000, azure_load=load)
        rep.offered_rps = len(wl) / duration_s
        log(f"capacity {rep.capacity_rps:.2f} req/s; replaying {len(wl)} requests over {minutes:g} min "
            f"(mean {rep.offered_rps:.2f} req/s, load {load:g})")
        prompts = bank.texts(wl, seed=seed)
        asyncio.run(replay(stack, wl.arrival_s, prompts, [int(x) for x in wl.output_tokens], rep,
                           sample_every_s=max(1.0, duration_s / 120), warmup_s=warmup_frac * duration_s))
        time.sleep(2.0)  # let the last output streams be deleted / cancels land
        keys1, used1 = redis_view(stack)
        rep.redis_keys, rep.redis_used_mb = (keys0, keys1), (round(used0, 2), round(used1, 2))
        rep.services_died = [f"{s.name} rc={s.proc.returncode}" for s in stack.services if not s.alive()]
    finally:
        stack.stop()
    return rep


def print_report(rep: SoakReport) -> None:
    print(f"soak {rep.minutes:g} min: capacity {rep.capacity_rps:.2f} req/s, offered {rep.offered_rps:.2f} req/s")
    print(f"requests {rep.requests}  ok {rep.ok}  refused {rep.refused}  LOST {rep.lost}  tokens {rep.tokens}")
    print(f"errors {rep.errors or 'none'}; e2e p50 {rep.e2e_p50_s} s, p99 {rep.e2e_p99_s} s")
    print(f"{'process':<26}{'start MB':>10}{'warm MB':>10}{'end MB':>10}{'growth':>9}")
    for name, v in sorted(rep.rss_mb.items()):
        print(f"{name:<26}{v['start']:>10.1f}{v['warm']:>10.1f}{v['end']:>10.1f}{v['growth_pct']:>8.2f}%")
    print(f"redis keys {rep.redis_keys[0]} -> {rep.redis_keys[1]}; used memory {rep.redis_used_mb[0]} -> "
          f"{rep.redis_used_mb[1]} MB; services died: {rep.services_died or 'none'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.7, help="mean offered load as a fraction of measured capacity")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--warmup-frac", type=float, default=0.25, help="share of the run before the memory baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = p.parse_args(argv)
    if not a.minutes > 0 or not 0 < a.load <= 2 or not 0 <= a.warmup_frac < 1:
        p.error("need --minutes > 0, 0 < --load <= 2, 0 <= --warmup-frac < 1")
    # SIGTERM (timeout, CI) unwinds through run()'s finally, so the stack's processes stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rep = run(a.minutes, a.load, a.workers, a.warmup_frac, a.seed)
    print_report(rep)
    if a.json:
        a.json.write_text(json.dumps(asdict(rep), indent=2))
    return 0 if rep.lost == 0 and not rep.services_died else 1


if __name__ == "__main__":
    sys.exit(main())
