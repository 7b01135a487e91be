#!/usr/bin/env python
"""nightjar against every static γ in closed loops, paired in time on one stack that stays up.

    .venv/bin/python scripts/bench_closed_ab.py [--clients 1,4,16,48] [--seconds 30] [--rounds 3]

``nightjar bench`` starts a fresh stack per policy, so one repeat's policies run minutes apart
and, on a shared machine, the step time moves by more than they differ (BENCHMARKS.md, the live
planner). Here the stack stays up for the whole run and ratios are taken within a round (or a
repeat of ``--rounds-per-repeat`` short rounds). How a round runs and what it writes: ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar import paths  # noqa: E402
from nightjar_tools.bench import report  # noqa: E402
from nightjar_tools.bench.compare import (CompareConfig, HeldByPlanner, KeepPublished, WorkloadPlan, RunningStack,  # noqa: E402
                                          run_on_stack, speed_probe_ms, wait_idle, warm_up)
from nightjar_tools.bench.probe import recording  # noqa: E402
from nightjar_tools.bench.workload import PromptBank, build  # noqa: E402
from nightjar_tools.serve import add_prior_surface_arg, prior_surface  # noqa: E402
from nightjar_tools.stack import sigterm_stops_stacks  # noqa: E402


def gamma_of(policy: str) -> int:
    return 0 if policy == "off" else int(policy.split(":", 1)[1])


def cpu_seconds(stack) -> dict[str, float]:
    """CPU seconds (user + system) each service of ``stack`` has used so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for svc in stack.services:
        try:
            fields = Path(f"/proc/{svc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            continue
        out[svc.name] = out.get(svc.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def run_recorded(stack, wl, texts: list[str], cfg: CompareConfig, label: str, record_to: Path | None):
    """``run_on_stack``; with ``record_to``, the run's engine steps saved there (replay format,
    ``probe.recording``)."""
    seen: list = []
    result, steps = await run_on_stack(stack, wl, texts, cfg, label, steps_into=seen)
    if record_to is not None:
        record_to.write_text(json.dumps(recording(seen, f"bench_closed_ab {label}, started {result.started_unix:.3f}")))
    return result, steps


def record_path(out: Path, clients: int, run: str, policy: str) -> Path:
    """Where ``--record`` puts one run's steps: nightjar's as steps_closedC_RUN.json (RUN: roundR
    or settle; what replays read), a static policy's with its name after
    (steps_closedC_roundR_fixed-1.json)."""
    tail = "" if policy == "nightjar" else "_" + policy.replace(":", "-")
    return out / f"steps_closed{clients}_{run}{tail}.json"


async def run(a: argparse.Namespace, out: Path) -> list[dict]:
    """One stack runs the nightjar planner and stays up for the whole run, as a server does. For a
    static policy's run its planner holds that policy (``HeldByPlanner``) and learns nothing from
    it, so nightjar's runs see only their own steps, as if the static runs had not happened. With
    ``--stacks 2`` the static policies run on a second stack without a planner instead, and the
    bench publishes each γ there (two stacks at the same γ and batch drift 6-18% apart for
    minutes: BENCHMARKS.md, the live planner, tenth session). Each round runs nightjar and every
    static policy back to back, C clients for ``--seconds`` after ``--warmup-s`` of warm-up, in
    alternating order. Prints one table per client count (``table``) and writes
    runs/bench/closed_ab-STAMP/results.json."""
    clients = [int(x) for x in a.clients.split(",")]
    statics = a.policies.split(",")
    cfg = CompareConfig(policies=("nightjar",), workloads=(WorkloadPlan(f"closed:{clients[0]}", a.seconds),), out_dir=out,
                        kv_budget_bytes=a.kv_budget_bytes, progress=False, seed=a.seed,
                        prior_surface=prior_surface(a.prior_surface, paths.DEFAULT_TARGET))
    bank, rows, version = PromptBank(), [], 0
    learner_cfg = cfg.stack_config("nightjar", out / "logs" / "nightjar")
    async with contextlib.AsyncExitStack() as up:
        if a.stacks == 1:
            learner = static = await up.enter_async_context(RunningStack(learner_cfg))
        else:
            static_cfg = cfg.stack_config("off", out / "logs" / "static", planner=False)
            first, second = (static_cfg, learner_cfg) if a.static_first else (learner_cfg, static_cfg)
            one, two = [await up.enter_async_context(RunningStack(c)) for c in (first, second)]
            learner, static = (two, one) if a.static_first else (one, two)
        for stack in (learner,) if static is learner else (learner, static):
            await warm_up(stack, cfg, bank)
        for c in clients:
            wl = build(f"closed:{c}", 1.0, a.seconds, seed=a.seed, scale=cfg.scale)
            wl = dataclasses.replace(wl, warmup_s=a.warmup_s, duration_s=a.warmup_s + a.seconds)
            texts = bank.texts(wl, a.seed)
            if a.settle_s > 0:  # the learner's first minute at this load, uncounted (reported)
                await wait_idle(learner)
                settle = dataclasses.replace(wl, warmup_s=0.0, duration_s=a.settle_s)
                result, steps = await run_recorded(learner, settle, texts, cfg, f"settle | closed:{c}",
                                                   record_path(out, c, "settle", "nightjar") if a.record else None)
                r = report.summarize(result, steps, warmup_s=0.0)
                print(f"closed:{c} settle, {a.settle_s:g} s uncounted: nightjar {r['tokens_per_s']:.1f} tok/s, "
                      f"{steps['gamma_switches']} switches / {steps['steps']} steps", file=sys.stderr, flush=True)
            for rnd in range(a.rounds):
                order = ["nightjar", *statics]
                for policy in order if rnd % 2 == 0 else order[::-1]:
                    stack = learner if policy == "nightjar" else static
                    await wait_idle(stack)
                    speed = speed_probe_ms()
                    cpu0 = cpu_seconds(stack)
                    record_to = record_path(out, c, f"round{rnd}", policy) if a.record else None
                    if policy == "nightjar":
                        result, steps = await run_recorded(stack, wl, texts, cfg, f"{policy} | closed:{c}", record_to)
                    else:
                        version += 100_000
                        hold = (HeldByPlanner(stack, policy) if a.stacks == 1 else
                                KeepPublished(stack, gamma_of(policy), name=policy, first_version=version))
                        async with hold:
                            result, steps = await run_recorded(stack, wl, texts, cfg, f"{policy} | closed:{c}", record_to)
                    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds(stack).items()}
                    r = report.summarize_workload(result, steps, wl)
                    rows.append({"clients": c, "round": rnd, "policy": policy, "tokens_per_s": r["tokens_per_s"],
                                 "makespan_tokens_per_s": r["makespan_tokens_per_s"],
                                 "ok": r["ok"], "sent": r["sent"], "steps": steps["steps"],
                                 "gamma_switches": steps["gamma_switches"], "load_steps": steps["load_steps"],
                                 "load_switches": steps["load_switches"], "spec_step_share": steps["spec_step_share"],
                                 "mean_batch": steps["mean_batch"], "speed_probe_ms": speed, "unix": time.time(),
                                 "cpu_s": cpu, "wall_s": result.wall_s, "cells": steps["cells"]})
                    print(f"closed:{c} round {rnd + 1}/{a.rounds} {policy}: {r['tokens_per_s']:.1f} tok/s, "
                          f"{steps['gamma_switches']} switches / {steps['steps']} steps, CPU s "
                          + " ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items())), file=sys.stderr, flush=True)
                    (out / "results.json").write_text(json.dumps({"args": vars(a), "runs": rows}, indent=1, default=str))
    return rows


def table(rows: list[dict], statics: list[str], per: int = 1) -> str:
    """One row per client count; a repeat pools ``per`` consecutive rounds (tokens/s averaged).
    Three measures of nightjar against the best static policy: paired per repeat with the policy
    whose run mean is highest; paired per repeat with whichever static was best in that repeat
    (where statics tie this is the luckiest of several noisy runs, a bias against nightjar); and
    the ratio of run means. Beside them, the same-arm speed: per repeat, nightjar's ms per
    emitted token over the best static's in the cell (batch bucket, γ) where the static spent
    most steps. It moves on its own: between two stacks, and on one stack too at 48 clients
    (BENCHMARKS.md, the live planner); where that ratio is far from 1 so is the throughput one,
    whatever the policy did."""
    lines = ["| clients | " + " | ".join(f"`{p}`" for p in statics) + " | `nightjar` | ÷ best static, per repeat (median) "
             "| ÷ each repeat's best (median) | ÷ best static's mean | same-arm ms/token ÷ best static's, per repeat (median) "
             "| switches / 1,000 steps under load (after the first repeat) | planner CPU, % of a core |",
             "|---:|" + "---:|" * (len(statics) + 7)]
    for c in dict.fromkeys(r["clients"] for r in rows):
        at = [r for r in rows if r["clients"] == c]
        mean = {p: statistics.mean(r["tokens_per_s"] for r in at if r["policy"] == p) for p in [*statics, "nightjar"]}
        best = max(statics, key=mean.__getitem__)
        paired, luckiest, same_arm = [], [], []
        for rep in sorted({r["round"] // per for r in at}):
            in_rep = [r for r in at if r["round"] // per == rep]
            tps = {p: statistics.mean(v) for p in [*statics, "nightjar"]
                   if len(v := [r["tokens_per_s"] for r in in_rep if r["policy"] == p]) == per}
            if len(tps) == len(statics) + 1:
                paired.append(tps["nightjar"] / tps[best])
                luckiest.append(tps["nightjar"] / max(tps[p] for p in statics))
                speed = same_arm_speed(in_rep, best)
                if speed is not None:
                    same_arm.append(speed)
        nj = [r for r in at if r["policy"] == "nightjar"]
        # under load only: the final drain walks the batch down through every bucket's γ
        switches, settled = switch_rate(nj), switch_rate([r for r in nj if r["round"] >= per])
        planner = 100 * sum(r["cpu_s"].get("planner", 0.0) for r in nj) / max(sum(r["wall_s"] for r in nj), 1e-9)

        def listed(xs: list[float]) -> str:
            return ", ".join(f"{x:.3f}" for x in xs) + (f" (**{statistics.median(xs):.3f}**)" if xs else "")
        lines.append(f"| {c} | " + " | ".join(f"{mean[p]:.0f}" for p in statics) + f" | {mean['nightjar']:.0f} | "
                     f"{listed(paired)} vs `{best}` | {listed(luckiest)} | {mean['nightjar'] / mean[best]:.3f} "
                     f"| {listed(same_arm) or '–'} | {switches:.1f} ({settled:.1f}) | {planner:.0f} |")
    return "\n".join(lines)


def switch_rate(runs: list[dict]) -> float:
    """γ switches per 1,000 engine steps under load, pooled over ``runs``."""
    steps = sum(r.get("load_steps", r["steps"]) for r in runs)
    return 1000 * sum(r.get("load_switches", r["gamma_switches"]) for r in runs) / max(steps, 1)


def same_arm_speed(rows: list[dict], static: str, min_steps: int = 30) -> float | None:
    """nightjar's ms per emitted token over ``static``'s, pooled over ``rows``, in the cell
    ("bucket|γ") where ``static`` ran most steps; None where nightjar ran under ``min_steps`` there."""
    mine_all = report.pool_cells(r.get("cells") for r in rows if r["policy"] == "nightjar")
    theirs_all = report.pool_cells(r.get("cells") for r in rows if r["policy"] == static)
    if not theirs_all:
        return None
    key = max(theirs_all, key=lambda k: theirs_all[k][0])
    mine, theirs = mine_all.get(key), theirs_all[key]
    if mine is None or mine[0] < min_steps or not mine[2] or not theirs[2]:
        return None
    return (mine[1] / mine[2]) / (theirs[1] / theirs[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(run),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16,48")
    p.add_argument("--policies", default="off,fixed:1,fixed:2,fixed:3,fixed:4", help="the static policies")
    p.add_argument("--seconds", type=float, default=30.0, help="counted seconds per run, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=10.0, help="uncounted seconds at the start of each run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="before each client count's rounds, run nightjar alone this long, uncounted: steady "
                        "load starts after the cold planner's learning (how long that takes is [headline]'s learning row)")
    p.add_argument("--record", action="store_true",
                   help="also save each run's engine steps (replay format): nightjar's as steps_closedC_roundR.json, "
                        "a static policy's as steps_closedC_roundR_POLICY.json")
    p.add_argument("--rounds-per-repeat", type=int, default=1,
                   help="consecutive rounds pooled into one repeat's ratio: short rounds interleave the "
                        "policies more finely against the machine's drift (BENCHMARKS.md, the live planner)")
    p.add_argument("--stacks", type=int, choices=(1, 2), default=1,
                   help="1: every policy on the planner's stack, static ones held by it; 2: static policies on a "
                        "second stack without a planner (how the tables before the eleventh session were measured)")
    p.add_argument("--static-first", action="store_true",
                   help="with --stacks 2, start the planner-less stack first (the stack started first ran the same steps ~5%% slower: "
                        "BENCHMARKS.md, the live planner, fourth and fifth sessions)")
    add_prior_surface_arg(p)
    p.add_argument("--kv-budget-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table-from", type=Path, default=None, metavar="RESULTS_JSON",
                   help="print the table of a finished run's results.json (its own --policies and "
                        "--rounds-per-repeat) and exit")
    a = p.parse_args(argv)
    if a.table_from is not None:
        done = json.loads(a.table_from.read_text())
        print(table(done["runs"], done["args"]["policies"].split(","), int(done["args"]["rounds_per_repeat"])))
        return 0
    out = a.out or ROOT / "runs" / "bench" / time.strftime("closed_ab-%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    with sigterm_stops_stacks():
        rows = asyncio.run(run(a, out))
    print(table(rows, a.policies.split(","), a.rounds_per_repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
