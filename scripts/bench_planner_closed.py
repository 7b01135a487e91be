"""nightjar against every static γ under steady closed-loop load, in the planner's simulator.

    .venv/bin/python scripts/bench_planner_closed.py [--clients 1,4,16,48,64] [--seeds 1,2,3,4,5,6]

A closed loop of C clients holds the batch at C, the steady regime a live planner must serve:
does nightjar match the best static γ there, on each cost surface, without switching often?
What it runs and prints: ``main``; its runs: BENCHMARKS.md, "The live planner".
"""

from __future__ import annotations

import argparse
import inspect
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
    """A closed loop of C clients is a saturated queue with the batch capped at C (32-token prompts,
    64-token outputs), on the measured ``cpu_tiny`` and ``cpu_serve`` surfaces and the roofline
    (where speculation stops paying on each: BENCHMARKS.md, "Serving-shaped pair and its cost
    surface"). Prints, per surface and C: each policy's tokens/s (first seed), nightjar ÷ the best
    static policy (mean and range over seeds), and nightjar's most γ switches per 1,000 steps and
    its share of steps at γ > 0 over the second half of the run (after warm-up). ±10% step-time noise,
    and with ``--drift`` a machine whose speed moves as a shared VM's does."""
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,16,48")
    ap.add_argument("--per-client", type=int, default=200, help="requests per client")
    ap.add_argument("--seeds", default="1", help="comma-separated simulation and policy seeds")
    ap.add_argument("--surfaces", default="cpu_tiny,cpu_serve,roofline")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="the machine's drift: every step time × one U(1 ± DRIFT) per 5 s (SimConfig.drift)")
    a = ap.parse_args(argv)
    seeds = [int(x) for x in a.seeds.split(",")]
    print("| surface | clients | " + " | ".join(STATIC) + " | nightjar | ÷ best static | switches / 1,000 steps | γ > 0 share |")
    print("|---|---:|" + "---:|" * (len(STATIC) + 4))
    for name in a.surfaces.split(","):
        surface = (roofline(gamma_max=4, max_batch=256) if name == "roofline"
                   else load_table(ROOT / "planner_svc" / "cost_surfaces" / f"{name}.json", max_batch=256))
        for c in (int(x) for x in a.clients.split(",")):
            n = c * a.per_client
            trace = Trace(f"closed:{c}", np.zeros(n), np.full(n, 32), np.full(n, 64))
            ratios, switches, shares = [], [], []
            for seed in seeds:
                cfg = SimConfig(gamma_max=4, max_batch=c, noise=0.1, seed=seed, kv_tokens=1 << 17, drift=a.drift)
                tps = {p: simulate(trace, make_policy(p, gamma_max=4), surface, cfg).throughput_tps for p in STATIC}
                policy = make_policy("nightjar", gamma_max=4, seed=seed)
                gammas: list[int] = []
                update = policy.update

                def spy(stats, update=update, gammas=gammas):
                    gammas.append(stats.gamma)
                    update(stats)

                policy.update = spy
                tps["nightjar"] = simulate(trace, policy, surface, cfg).throughput_tps
                steady = np.array(gammas[len(gammas) // 2:])
                switches.append(1000.0 * np.count_nonzero(np.diff(steady)) / len(steady))
                shares.append((steady > 0).mean())
                ratios.append(tps["nightjar"] / max(tps[p] for p in STATIC))
                if seed == seeds[0]:
                    first = tps  # the table shows the first seed's figures
            spread = f" ({min(ratios):.3f}–{max(ratios):.3f})" if len(ratios) > 1 else ""
            print(f"| {name} | {c} | " + " | ".join(f"{first[p]:.0f}" for p in STATIC)
                  + f" | {first['nightjar']:.0f} | {np.mean(ratios):.3f}{spread} | {max(switches):.1f} | {np.mean(shares):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
