"""How far can any γ policy beat a fixed γ on a trace? An Amdahl bound from the engine's own steps.

While a trace overloads the stack the engine is busy throughout, so each policy's output
tokens/s is 1 / (prefill ms + decode ms per output token). γ and the draft's residency change only
the decode part: the prompts are prefilled whatever the policy. So over the overloaded stretch no
policy beats the baseline by more than

    (prefill + decode ms per token of the baseline) / (the least prefill ms per token of any policy
    on that trace + the best decode ms per token any recording in the folder reached, in a cell of
    >= --min-steps pure decode steps)

Below capacity every policy serves the offered load, so a whole trace's ratio is diluted towards
1 from there. Prefill time is estimated as in ``summarize_steps``' prefill share: a step that
carries prefill tokens, less a pure decode step of its (batch bucket, γ) cell in the same run.
``--window burst=60:100`` also gives each run's output tokens/s in that stretch of the trace (seconds
from its first step), where every policy queued: the ratio the bound is about, measured.

    .venv/bin/python scripts/overload_bound.py runs/bench/X/steps [--baseline fixed:4] [--min-steps 20] \
        [--window WORKLOAD=FROM:TO ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from nightjar_tools.bench.probe import parse_bench_source, steps_of, summarize_steps


def per_token(rec: dict, min_steps: int, window: tuple[float, float] | None) -> dict:
    """Prefill and decode ms per output token of one recorded run, its best pure decode cell, and
    its output tokens/s in ``window`` (seconds from its first step)."""
    steps = steps_of(rec)
    s = summarize_steps(steps)
    in_window = None
    if window and steps:
        t0, (a, b) = steps[0].unix_ms / 1000, window
        in_window = sum(x.emitted_tokens for x in steps if a <= x.unix_ms / 1000 - t0 < b) / (b - a)
    total_ms = sum(x.step_ms for x in steps)
    tokens = max(s["emitted_tokens"], 1)
    prefill_ms = s["prefill_share"] * total_ms
    decode = (total_ms - prefill_ms) / tokens
    # None where no cell has enough steps: a run's mean decode cost is no evidence of the machine's best.
    best = min(((ms / tok, cell) for cell, (n, ms, tok) in s["cells"].items() if n >= min_steps and tok),
               default=(None, None))
    return {"prefill": prefill_ms / tokens, "decode": decode, "share": s["prefill_share"],
            "best": best[0], "best_cell": best[1], "window_tps": in_window}


def _window(text: str) -> tuple[str, tuple[float, float]]:
    try:
        wl, span = text.split("=", 1)
        a, b = (float(x) for x in span.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WORKLOAD=FROM:TO in seconds, e.g. burst=60:100, not {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= FROM < TO")
    return wl, (a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps_dir", type=Path, help="a bench run's OUT/steps (nightjar bench --record)")
    ap.add_argument("--baseline", default="fixed:4", help="the policy the bound is relative to")
    ap.add_argument("--min-steps", type=int, default=20, help="pure decode steps a cell needs to count as reached")
    ap.add_argument("--window", type=_window, action="append", default=[], metavar="WORKLOAD=FROM:TO",
                    help="also give each run's output tokens/s in this stretch of that workload (repeatable)")
    a = ap.parse_args()
    windows = dict(a.window)
    runs: dict[str, list[tuple[str, int, dict]]] = defaultdict(list)
    for path in sorted(a.steps_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        ran = parse_bench_source(rec.get("source", ""))
        if ran is None:
            raise SystemExit(f"{path}: not a bench recording (source {rec.get('source')!r})")
        policy, workload, repeat = ran
        runs[workload].append((policy, repeat, per_token(rec, a.min_steps, windows.get(workload))))
    print("| workload | policy | repeat | prefill share | prefill ms/token | decode ms/token | best cell (bucket|γ) ms/token "
          "| tokens/s in the window |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for wl, rs in runs.items():
        for policy, rep, t in sorted(rs, key=lambda r: (r[0], r[1])):
            tps = "–" if t["window_tps"] is None else f"{t['window_tps']:.1f}"
            cell = "–" if t["best"] is None else f"{t['best_cell']}: {t['best']:.2f}"
            print(f"| {wl} | {policy} | {rep} | {t['share']:.2f} | {t['prefill']:.2f} | {t['decode']:.2f} | {cell} | {tps} |")
    # The engine's best decode cost is the machine's, not the trace's: a prefill-bound trace
    # rarely runs enough pure decode steps to show it.
    reached = [(t["best"], t["best_cell"], f"{wl} {policy} {rep}") for wl, rs in runs.items()
               for policy, rep, t in rs if t["best"] is not None]
    if not reached:
        raise SystemExit(f"no run has a pure decode cell of >= {a.min_steps} steps: lower --min-steps")
    best, cell, where = min(reached)
    print(f"\nBest decode cost: {best:.2f} ms/token (cell {cell}, {where}). Bound on any policy ÷ {a.baseline} "
          f"while the trace overloads, per {a.baseline} run:")
    for wl, rs in runs.items():
        # The least prefill cost: a mixed step's γ > 0 verify costs more than the pure decode step
        # it is measured against, and that excess would otherwise count as the baseline's prefill.
        prefill = min(t["prefill"] for _, _, t in rs)
        bounds = [(t["prefill"] + t["decode"]) / (prefill + best) for policy, _, t in rs if policy == a.baseline]
        if bounds:
            print(f"- {wl}: " + ", ".join(f"{b:.3f}" for b in bounds))


if __name__ == "__main__":
    main()
