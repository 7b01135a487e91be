#!/usr/bin/env python
"""Every policy × every trace in the planner's simulator: throughput, latency, TTFT, switches.

    .venv/bin/python scripts/bench_planner.py                 # full table (a few minutes on 2 cores)
    .venv/bin/python scripts/bench_planner.py --requests 500  # quick look

The planner's goals are checked at the end, so a policy change is judged on every trace at once.
Which cost surface, how throughput is counted, and the goals: ``main`` (shown by --help).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner_svc.policies import make_policy  # noqa: E402
from planner_svc.simulator import (AcceptanceProcess, SimConfig, load_table, oracle_policy, roofline,  # noqa: E402
                                   simulate, trace_for)

MEASURED = Path(__file__).resolve().parents[1] / "planner_svc" / "cost_surfaces" / "cpu_tiny.json"
TRACES = ["poisson:0.2", "poisson:0.5", "poisson:0.8", "poisson:1.2", "burst", "ramp", "oscillation",
          "azure_conv", "azure_code"]
DYNAMIC = {"burst", "ramp", "oscillation", "azure_conv", "azure_code"}
POLICIES = ["nightjar", "nightjar-nooffload", "off", "fixed:3", "threshold:8", "table:1=4,4=2,16=1,32=0", "ucb",
            "heuristic", "ema"]
FIXED = "fixed:3"


METRICS = [
    ("throughput, tokens/s", lambda r: f"{r.throughput_tps:.0f}"),
    ("mean end-to-end latency, s", lambda r: f"{r.mean_latency_ms / 1e3:.2f}"),
    ("p99 end-to-end latency, s", lambda r: f"{r.p99_latency_ms / 1e3:.2f}"),
    ("mean TTFT, s", lambda r: f"{r.mean_ttft_ms / 1e3:.2f}"),
    ("γ switches per 1000 steps / draft offloads", lambda r: f"{r.switches_per_1000_steps:.0f} / {r.offloads}"),
]


def _matrices(matrix: dict[str, dict]) -> None:
    """One policy × trace table per metric (the compact form used in BENCHMARKS.md)."""
    shapes = list(matrix)
    specs = list(next(iter(matrix.values()))) if matrix else []
    for title, cell in METRICS:
        print(f"\n#### {title}\n")
        print("| policy | " + " | ".join(shapes) + " |")
        print("|---|" + "---:|" * len(shapes))
        for spec in specs:
            name = "oracle (hindsight)" if spec == "oracle" else spec
            print(f"| {name} | " + " | ".join(cell(matrix[t][spec]) for t in shapes) + " |")


def main(argv: list[str] | None = None) -> int:
    """The cost surface is the measured CPU table when planner_svc/cost_surfaces/cpu_tiny.json exists
    (or ``--surface FILE``), else the parametric roofline. Throughput = output tokens / (last
    completion − first arrival); the goals checked at the end: nightjar best or within 2% of the
    best throughput on every trace, and ≥ 1.27× fixed-γ speculation (fixed:3) on the dynamic traces."""
    p = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per trace")
    p.add_argument("--traces", default=";".join(TRACES), help="';'-separated trace shapes")
    p.add_argument("--policies", default=";".join(POLICIES), help="';'-separated policy specs")
    p.add_argument("--surface", default=None, help="measured cost table (JSON); default: cpu_tiny.json if present")
    p.add_argument("--roofline", action="store_true", help="use the parametric roofline even if a table exists")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gamma-max", type=int, default=4)
    p.add_argument("--noise", type=float, default=0.1, help="step-time noise, ± fraction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-tokens", type=int, default=SimConfig.kv_tokens, help="target KV pool per worker, draft resident")
    p.add_argument("--draft-kv-share", type=float, default=SimConfig.draft_kv_share,
                   help="offloading the draft grows the KV pool by this share")
    p.add_argument("--no-oracle", action="store_true", help="skip the hindsight-oracle reference rows")
    p.add_argument("--matrices-only", action="store_true", help="print only the policy × trace matrices and goals")
    a = p.parse_args(argv)

    path = Path(a.surface) if a.surface else MEASURED
    if not a.roofline and path.exists():
        surface = load_table(path, max_batch=256)
        a.gamma_max = min(a.gamma_max, surface.gamma_max)  # a table measured fewer γ than asked
    else:
        surface = roofline(a.gamma_max, 256)
    config = SimConfig(gamma_max=a.gamma_max, workers=a.workers, noise=a.noise, seed=a.seed, kv_tokens=a.kv_tokens,
                       draft_kv_share=a.draft_kv_share)
    acceptance = AcceptanceProcess(surface.acceptance or config.alphas, a.gamma_max)
    policies = []
    for spec in (s for s in a.policies.split(";") if s):
        try:
            make_policy(spec, gamma_max=a.gamma_max)
            policies.append(spec)
        except ValueError as exc:
            print(f"# skipping {spec}: {exc}")
    traces = [s for s in a.traces.split(";") if s]
    print(f"# cost surface: {surface.name}; gamma_max={a.gamma_max}; workers={a.workers}; noise=±{a.noise:.0%}; "
          f"requests/trace={a.requests}; KV {config.kv_tokens} tokens/worker (+{config.draft_kv_share:.0%} with the "
          f"draft offloaded); E[tokens/step] by γ = {[round(x, 2) for x in acceptance.expected]}")
    summary, total_steps, total_s, total_cpu_s = [], 0, 0.0, 0.0
    matrix: dict[str, dict[str, object]] = {}  # trace -> policy -> SimResult
    for shape in traces:
        trace = trace_for(shape, surface, config, requests=a.requests, seed=a.seed)
        rows = {}
        specs = policies + ([] if a.no_oracle else ["oracle"])
        for spec in specs:
            if spec == "oracle":
                policy = oracle_policy(surface, acceptance, a.gamma_max, config.max_batch)
            else:
                policy = make_policy(spec, gamma_max=a.gamma_max, seed=a.seed)
            t0, c0 = time.perf_counter(), time.process_time()
            rows[spec] = simulate(trace, policy, surface, config)
            total_s += time.perf_counter() - t0
            total_cpu_s += time.process_time() - c0
            total_steps += rows[spec].steps
        matrix[shape] = rows
        base = rows.get(FIXED)
        if a.matrices_only:
            continue
        print(f"\n### {shape} ({len(trace.arrival_ms)} requests, mean prompt {trace.mean_prompt:.0f}, "
              f"mean output {trace.mean_output:.0f} tokens)\n")
        print("| policy | throughput tok/s | × fixed:3 | mean latency s | p99 latency s | mean TTFT s | "
              "switches /1k steps | offloads |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for spec, r in rows.items():
            ratio = f"{r.throughput_tps / base.throughput_tps:.2f}" if base else "–"
            name = f"{spec} (reference)" if spec == "oracle" else spec
            print(f"| {name} | {r.throughput_tps:.0f} | {ratio} | {r.mean_latency_ms / 1e3:.2f} | "
                  f"{r.p99_latency_ms / 1e3:.2f} | {r.mean_ttft_ms / 1e3:.2f} | {r.switches_per_1000_steps:.1f} | "
                  f"{r.offloads} |")
    for shape, rows in matrix.items():
        if "nightjar" in rows:
            base = rows.get(FIXED)
            best = max((r.throughput_tps, s) for s, r in rows.items() if s != "oracle")
            nj = rows["nightjar"]
            if not any(row[0] == shape for row in summary):
                summary.append((shape, nj.throughput_tps / best[0], best[1],
                                nj.throughput_tps / base.throughput_tps if base else float("nan"),
                                nj.mean_latency_ms / min(r.mean_latency_ms for s, r in rows.items() if s != "oracle")))
    _matrices(matrix)
    if summary:
        print("\n### Goals\n")
        print("| trace | nightjar / best throughput | best policy | within 2%? | nightjar / fixed:3 | ≥ 1.27× (dynamic)? "
              "| nightjar / best mean latency |")
        print("|---|---:|---|---|---:|---|---:|")
        for shape, vs_best, best_name, vs_fixed, vs_lat in summary:
            dyn = ("yes" if vs_fixed >= 1.27 else "no") if shape in DYNAMIC else "n/a (stationary)"
            print(f"| {shape} | {vs_best:.3f} | {best_name} | {'yes' if vs_best >= 0.98 else 'no'} | {vs_fixed:.2f} | "
                  f"{dyn} | {vs_lat:.3f} |")
    # CPU time too: on a shared machine wall time mostly measures the neighbours.
    print(f"\n# simulator speed: {total_steps} steps in {total_s:.1f} s wall / {total_cpu_s:.1f} s CPU = "
          f"{total_steps / max(total_s, 1e-9):,.0f} steps/s wall, {total_steps / max(total_cpu_s, 1e-9):,.0f} per CPU-second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
