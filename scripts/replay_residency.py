"""Replay a bench run's recorded steps through a fresh nightjar planner and print when it would
move the draft: the residency decisions a recording implies at a given ``kv_full_fraction``.

    .venv/bin/python scripts/replay_residency.py runs/bench/X/steps/nightjar_burst.json [...] \
        [--kv-full-fraction 0.8] [--prior-surface planner_svc/cost_surfaces/cpu_serve_xeon480.json]

The planner learns from the recorded γs and batches, not from its own choices, so this shows the
residency rule's reading of what happened, not a rerun: after a replayed offload the recorded
batch does not grow, and a reload may follow that the live run would not make.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar.messages import Residency  # noqa: E402
from nightjar_tools.bench.probe import steps_of  # noqa: E402
from planner_svc.config import PlannerConfig  # noqa: E402
from planner_svc.policies.nightjar import NightjarPolicy, NightjarSettings  # noqa: E402
from planner_svc.policies.residency import ResidencySettings  # noqa: E402


def replay(path: Path, kv_full_fraction: float, prior_surface: str | None) -> list[tuple[float, str]]:
    """-> [(seconds from the first step, directive)] at each change of the directive."""
    policy = NightjarPolicy(NightjarSettings(residency=ResidencySettings(kv_full_fraction=kv_full_fraction)),
                            gamma_max=PlannerConfig.gamma_max)
    prior = PlannerConfig(policy="nightjar", prior_surface=prior_surface).surface_prior()
    if prior is not None:
        policy.warm_start(prior)
    steps = steps_of(json.loads(path.read_text()))
    changes, last = [], Residency.RESIDENT
    for st in steps:
        policy.update(st)
        now = policy.residency_for(st.worker_id)
        if now != last:
            changes.append(((st.unix_ms - steps[0].unix_ms) / 1000, now))
            last = now
    return changes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recordings", nargs="+", type=Path)
    p.add_argument("--kv-full-fraction", type=float, default=ResidencySettings.kv_full_fraction)
    p.add_argument("--prior-surface", default=str(ROOT / "planner_svc/cost_surfaces/cpu_serve_xeon480.json"),
                   help="the planner's warm start, as the bench gave it ('' for none)")
    a = p.parse_args()
    for path in a.recordings:
        changes = replay(path, a.kv_full_fraction, a.prior_surface or None)
        print(f"{path.name}: " + (", ".join(f"{d} at {t:.1f} s" for t, d in changes) or "the draft stays"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
