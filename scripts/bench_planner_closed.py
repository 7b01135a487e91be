"""nightjar against every static γ under steady closed-loop load, in the planner's simulator.

    .venv/bin/python scripts/bench_planner_closed.py [--clients 1,4,16,48] [--per-client 300]

A closed loop of C clients is a saturated queue with the batch capped at C (32-token prompts,
64-token outputs). Two surfaces: the measured ``cpu_tiny`` (speculation pays at every batch
size) and the roofline (compute-bound past 16 tokens a pass: γ = 0 wins from batch 16). Prints,
per surface and C: each policy's tokens/s, nightjar ÷ the best static policy, and nightjar's γ
switches per 1,000 steps and share of steps at γ > 0 over the second half of the run (after
warm-up). ±10% step-time noise, seed 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner_svc.policies import make_policy  # noqa: E402
from planner_svc.simulator import SimConfig, load_table, simulate  # noqa: E402
from planner_svc.simulator.cost_surface import roofline  # noqa: E402
from planner_svc.simulator.trace import Trace  # noqa: E402

STATIC = ("off", "fixed:1", "fixed:2", "fixed:3", "fixed:4")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,16,48")
    ap.add_argument("--per-client", type=int, default=300, help="requests per client")
    a = ap.parse_args(argv)
    surfaces = {"cpu_tiny": load_table(ROOT / "planner_svc" / "cost_surfaces" / "cpu_tiny.json", max_batch=256),
                "roofline": roofline(gamma_max=4, max_batch=256)}
    print("| surface | clients | " + " | ".join(STATIC) + " | nightjar | ÷ best static | switches / 1,000 steps | γ > 0 share |")
    print("|---|---:|" + "---:|" * (len(STATIC) + 4))
    for name, surface in surfaces.items():
        for c in (int(x) for x in a.clients.split(",")):
            n = c * a.per_client
            trace = Trace(f"closed:{c}", np.zeros(n), np.full(n, 32), np.full(n, 64))
            cfg = SimConfig(gamma_max=4, max_batch=c, noise=0.1, seed=1, kv_tokens=1 << 17)
            tps = {p: simulate(trace, make_policy(p, gamma_max=4), surface, cfg).throughput_tps for p in STATIC}
            policy = make_policy("nightjar", gamma_max=4, seed=1)
            gammas: list[int] = []
            update = policy.update

            def spy(stats, update=update, gammas=gammas):
                gammas.append(stats.gamma)
                update(stats)

            policy.update = spy
            tps["nightjar"] = simulate(trace, policy, surface, cfg).throughput_tps
            steady = np.array(gammas[len(gammas) // 2:])
            switches = 1000.0 * np.count_nonzero(np.diff(steady)) / len(steady)
            best = max(tps[p] for p in STATIC)
            print(f"| {name} | {c} | " + " | ".join(f"{tps[p]:.0f}" for p in STATIC)
                  + f" | {tps['nightjar']:.0f} | {tps['nightjar'] / best:.3f} | {switches:.1f} | {(steady > 0).mean():.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
