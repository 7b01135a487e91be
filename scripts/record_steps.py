#!/usr/bin/env python
"""Record a live nightjar stack's engine steps under a closed loop, in the planner tests' replay format.

    .venv/bin/python scripts/record_steps.py --clients 48 --seconds 90 --out runs/exp/rec48.json

A fresh stack (serving pair, KV 256 MiB) runs ``closed:C`` after 10 s of warm-up; the stats
stream's steps are saved as {"source", "fields", "rows"} (tests/planner_svc/data holds such
recordings; ``replay`` in tests/planner_svc/test_planner_regimes.py feeds them to a policy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar_tools.bench.compare import CompareConfig, WorkloadPlan, RunningStack, run_on_stack, warm_up  # noqa: E402
from nightjar_tools.bench.probe import recording  # noqa: E402
from nightjar_tools.bench.workload import PromptBank, build  # noqa: E402


async def record(a: argparse.Namespace) -> dict:
    logs = a.out.with_suffix("").with_name(a.out.stem + "_logs")
    cfg = CompareConfig(policies=("nightjar",), workloads=(WorkloadPlan(f"closed:{a.clients}", a.seconds),), out_dir=logs,
                        kv_budget_bytes=a.kv_budget_bytes, progress=False, seed=0)
    bank, steps = PromptBank(), []
    async with RunningStack(cfg.stack_config("nightjar", logs)) as stack:
        await warm_up(stack, cfg, bank)
        wl = build(f"closed:{a.clients}", 1.0, a.seconds, seed=0, scale=cfg.scale)
        _, summary = await run_on_stack(stack, wl, bank.texts(wl, 0), cfg, "record", steps_into=steps)
    print({k: v for k, v in summary.items() if k != "cells"}, file=sys.stderr)
    return recording(steps, f"live nightjar stack, closed:{a.clients} for {a.seconds:g} s after 10 s of warm-up, serving pair")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--kv-budget-bytes", type=int, default=256 << 20)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(asyncio.run(record(a))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
