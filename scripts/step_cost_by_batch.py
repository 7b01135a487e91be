"""Is one policy's engine step dearer than another's at the same batch? Compare two step
recordings (``nightjar bench --record``: OUT/steps/POLICY_WORKLOAD.json) batch size by batch size.

A bench run's cells (results.json, ``engine.cells``) pool the steps of a batch bucket; within a
bucket the cost per token moves with the batch (1.3x from batch 5 to 8 on the Zen 4 machine), so
two policies that fill a bucket differently differ there without either step being dearer.
This script holds the batch fixed: for every batch size both recordings ran pure decode steps
at the given γ (no prefill, no draft catch-up), each one's median verify time; and overall, the
ratio of the medians weighted by the second recording's steps at each batch.

    .venv/bin/python scripts/step_cost_by_batch.py runs/bench/X/steps/off_burst.json \
        runs/bench/X/steps/nightjar_burst.json [--gamma 0] [--min-steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def verify_ms_by_batch(path: Path, gamma: int) -> dict[int, list[float]]:
    data = json.loads(path.read_text())
    out: dict[int, list[float]] = defaultdict(list)
    for values in data["rows"]:
        row = dict(zip(data["fields"], values))
        if row["batch_size"] > 0 and row["gamma"] == gamma and not row["prefill_tokens"] and not row["catchup_tokens"]:
            out[row["batch_size"]].append(row["verify_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="recording to compare against (e.g. off's)")
    ap.add_argument("other", type=Path, help="recording to compare (e.g. nightjar's)")
    ap.add_argument("--gamma", type=int, default=0)
    ap.add_argument("--min-steps", type=int, default=3, help="skip a batch size with fewer steps in either")
    a = ap.parse_args()
    base, other = verify_ms_by_batch(a.base, a.gamma), verify_ms_by_batch(a.other, a.gamma)
    print(f"γ = {a.gamma}: median verify ms of pure decode steps\n")
    print(f"| batch | {a.base.stem} steps | ms | {a.other.stem} steps | ms | ratio |\n|---:|---:|---:|---:|---:|---:|")
    spent = expected = 0.0
    for b in sorted(set(base) & set(other)):
        if min(len(base[b]), len(other[b])) < a.min_steps:
            continue
        mb, mo = statistics.median(base[b]), statistics.median(other[b])
        spent += mo * len(other[b])
        expected += mb * len(other[b])
        print(f"| {b} | {len(base[b])} | {mb:.2f} | {len(other[b])} | {mo:.2f} | {mo / mb:.3f} |")
    if expected:
        print(f"\n{a.other.stem} ÷ {a.base.stem} at the same batch, weighted by {a.other.stem}'s steps: {spent / expected:.3f}")


if __name__ == "__main__":
    main()
