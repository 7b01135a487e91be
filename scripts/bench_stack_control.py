#!/usr/bin/env python
"""Does the planner's presence slow the engine? Three stacks side by side, one static γ.

    .venv/bin/python scripts/bench_stack_control.py --clients 16 --gamma 1 [--seconds 15] [--rounds 9]

N runs the nightjar planner, P the planner service playing ``fixed:G``, S no planner (the bench
publishes ``fixed:G``). Rounds rotate and reverse the order; each run prints emitted tokens/s and
the median pure-decode step per γ, so P ÷ S isolates the planner service (BENCHMARKS.md, the live
planner, fourth session). Stacks start in the order S, P, N.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar_tools.bench.compare import (CompareConfig, KeepPublished, WorkloadPlan, RunningStack,  # noqa: E402
                                          wait_idle, warm_up)
from nightjar_tools.bench.loadgen import LoadConfig, run_load  # noqa: E402
from nightjar_tools.bench.probe import StackProbe  # noqa: E402
from nightjar_tools.bench.workload import PromptBank, build  # noqa: E402


def step_summary(steps, since_ms: float) -> dict:
    decode = [s for s in steps if s.unix_ms >= since_ms and s.batch_size > 0]
    by_gamma: dict[int, list[float]] = {}
    for s in decode:
        if s.prefill_tokens == 0 and s.catchup_tokens == 0:
            by_gamma.setdefault(s.gamma, []).append(s.step_ms)
    return {"steps": len(decode), "emitted": sum(s.emitted_tokens for s in decode),
            "median_step_ms": {g: round(statistics.median(v), 2) for g, v in sorted(by_gamma.items())},
            "steps_by_gamma": {g: len(v) for g, v in sorted(by_gamma.items())}}


async def one(stack, wl, texts, cfg) -> dict:
    probe = StackProbe(stack.redis_url, stack.cfg.key_prefix)
    try:
        await probe.start()
        load = LoadConfig(target=stack.address, max_duration_s=wl.duration_s, drain_timeout_s=cfg.drain_timeout_s,
                          seed=cfg.seed, progress=False)
        result = await run_load(wl, texts, load, probe=probe)
        await probe.read_steps()
        return step_summary(probe.steps, (result.started_unix + wl.warmup_s) * 1000)
    finally:
        await probe.close()


async def run(a: argparse.Namespace) -> list[dict]:
    cfg = CompareConfig(policies=("nightjar",), workloads=(WorkloadPlan(f"closed:{a.clients}", a.seconds),), out_dir=a.out,
                        kv_budget_bytes=a.kv_budget_bytes, progress=False, seed=0)
    bank, rows, version = PromptBank(), [], 0
    async with RunningStack(cfg.stack_config("off", a.out / "S", planner=False)) as S, \
            RunningStack(cfg.stack_config(f"fixed:{a.gamma}", a.out / "P")) as P, \
            RunningStack(cfg.stack_config("nightjar", a.out / "N")) as N:
        stacks = {"N": N, "P": P, "S": S}
        for stack in stacks.values():
            await warm_up(stack, cfg, bank)
        wl = build(f"closed:{a.clients}", 1.0, a.seconds, seed=0, scale=cfg.scale)
        wl = dataclasses.replace(wl, warmup_s=a.warmup_s, duration_s=a.warmup_s + a.seconds)
        texts = bank.texts(wl, 0)
        for rnd in range(a.rounds):
            order = ["N", "P", "S"][rnd % 3:] + ["N", "P", "S"][:rnd % 3]
            for name in order if rnd % 2 == 0 else order[::-1]:
                await wait_idle(stacks[name])
                if name == "S":
                    version += 1000
                    async with KeepPublished(S, a.gamma, name=f"fixed:{a.gamma}", first_version=version):
                        s = await one(S, wl, texts, cfg)
                else:
                    s = await one(stacks[name], wl, texts, cfg)
                rows.append({"round": rnd, "stack": name, "tokens_per_s": s["emitted"] / a.seconds, **s})
                print(json.dumps(rows[-1]), flush=True)
    (a.out / "rows.json").write_text(json.dumps(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--gamma", type=int, default=1, help="the static γ of P and S")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--kv-budget-bytes", type=int, default=256 << 20)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "stack_control")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(run(a))
    for rnd in sorted({r["round"] for r in rows}):
        at = {r["stack"]: r for r in rows if r["round"] == rnd}
        p_ms, s_ms = at["P"]["median_step_ms"].get(a.gamma), at["S"]["median_step_ms"].get(a.gamma)
        if p_ms and s_ms:
            print(f"round {rnd}: P ÷ S median γ = {a.gamma} step {p_ms / s_ms:.3f}; tokens/s N {at['N']['tokens_per_s']:.0f} "
                  f"P {at['P']['tokens_per_s']:.0f} S {at['S']['tokens_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
