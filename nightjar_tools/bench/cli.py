"""``nightjar bench``: replay real and synthetic load against the stack and compare policies.

Two modes:
- compare (default): start a fresh stack per policy, calibrate, run the same workloads on each,
  write results.json, report.md and the plots; ``--quick`` is a couple of minutes' smoke run;
- ``--target HOST:PORT``: drive a stack that is already running (one policy, whatever it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

from nightjar import paths
from nightjar_tools.serve import add_prior_surface_arg, prior_surface
from nightjar_tools.stack import sigterm_stops_stacks

# The static peers read the best γ per batch size off the prior surface (S; compare.resolve_policy):
# vLLM's table tuned as its docs tune it, from an offline profile of this pair on this kind of
# machine, and vLLM V0's threshold at that profile's crossover. The strongest static baselines,
# not guesses.
FULL_POLICIES = ("off", "fixed:G", "threshold:S:G", "table:S", "ucb", "nightjar", "nightjar-nooffload")
FULL_WORKLOADS = ("burst@30", "azure_conv@25", "poisson:0.3@10", "poisson:1.5@15")
# --headline: every peer's γ policy on every workload the goals name, runs long enough to beat the
# machine's drift (>= 2 min per dynamic trace), three interleaved repeats.
HEADLINE_POLICIES = ("off", "fixed:G", "threshold:S:G", "table:S", "ucb", "heuristic", "ema", "nightjar",
                     "nightjar-nooffload")
HEADLINE_WORKLOADS = ("burst@120", "oscillation@120", "ramp@120", "azure_conv@120", "azure_code@120", "poisson:0.3@60",
                      "poisson:1.5@60")
# [headline]'s memory: an 8B target (16 GB) and a 1B draft (2.5 GB) on a 24 GB card leave ~5.5 GB
# of KV, so the draft's weights are ~45% of the KV pool, and offloading it grows the pool ~1.45x.
HEADLINE_DRAFT_SHARE = 0.45
DEFAULT_DRAFT_SHARE = 0.6  # the memory work's overload scenario
DEFAULT_MAX_REQUESTS = 2000
QUICK_POLICIES = ("fixed:G", "nightjar")
QUICK_WORKLOADS = ("burst@20",)
# Timelines copied into --plots-dir (every run's timeline stays in the output folder).
HEADLINE_TIMELINES = ("nightjar", "fixed")


def _workload(text: str):
    from nightjar_tools.bench.compare import WorkloadPlan

    spec, at, dur = text.partition("@")
    try:
        duration = float(dur) if at else 30.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"workload {text!r}: expected SPEC@SECONDS, e.g. burst@40") from None
    if duration <= 0:
        raise argparse.ArgumentTypeError(f"workload {text!r}: duration must be > 0")
    return WorkloadPlan(spec, duration)


def _at_least_one(text: str) -> int:
    """--max-requests in both modes (compare and --target) is checked here, before any stack starts."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smoke run: fixed-γ vs nightjar on a 20 s burst (a few minutes)")
    mode.add_argument("--headline", action="store_true",
                      help="the whole headline matrix: every peer policy (incl. ema, heuristic) on burst, oscillation, "
                           "ramp, the Azure replays and steady low/overload, 3 repeats, --draft-share 0.45 (hours; progress and "
                           "ETA on stderr)")
    p.add_argument("--target", default=None, help="HOST:PORT of a running stack (no restarts, no comparison)")
    p.add_argument("--redis-url", default=None, help="with --target: the stack's Redis (redis:// or redis+cluster://), for the engine-side metrics")
    p.add_argument("--key-prefix", default="nj")
    p.add_argument("--policies", nargs="+", default=None,
                   help="policy specs; G stands for the calibrated best γ at batch 1 (the smallest within 3%% of the "
                        "fastest), S for the prior surface's best γ per batch size (table:S, threshold:S:G) (default: the "
                        "full set)")
    p.add_argument("--workloads", nargs="+", type=_workload, default=None,
                   help="SPEC@SECONDS: poisson:ρ, rates:ρ1,ρ2,..., burst, ramp, oscillation, azure_conv, azure_code, "
                        "closed:C (C clients in a closed loop, 64-token requests; tokens/s over SECONDS after a 10 s warm-up, "
                        "while all C send)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-scale", type=float, default=0.25, help="× the trace's prompt lengths")
    p.add_argument("--output-scale", type=float, default=0.25, help="× the trace's output lengths")
    p.add_argument("--max-output", type=int, default=64, help="cap on a request's output tokens after scaling")
    p.add_argument("--draft-share", type=float, default=None,
                   help=f"size the worker's KV budget so the draft's weights are this share of it (default "
                        f"{DEFAULT_DRAFT_SHARE}, the memory work's overload scenario; with --headline {HEADLINE_DRAFT_SHARE}, "
                        "an 8B/1B pair's on a 24 GB card); 0 = the engine's default budget")
    p.add_argument("--kv-budget-bytes", type=int, default=None, help="worker KV budget in bytes (overrides --draft-share)")
    p.add_argument("--target-model", type=Path, default=paths.DEFAULT_TARGET, help="the workers' target model folder")
    p.add_argument("--draft-model", type=Path, default=paths.DEFAULT_DRAFT,
                   help="the workers' draft model folder (--draft-share is of its weights)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker (1 avoids OpenMP stalls on a busy machine)")
    p.add_argument("--prefill-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the CPU workers' prompt matmuls (nightjar serve --prefill-dtype); default float32, with "
                        "--headline bfloat16 where the CPU has a native bf16 path (AMX or AVX512-BF16)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable), e.g. --worker-arg=--max-running=32")
    p.add_argument("--planner-arg", action="append", default=[], help="extra planner argument (repeatable)")
    add_prior_surface_arg(p)
    p.add_argument("--capacity-rps", type=float, default=None, help="skip the capacity probe")
    p.add_argument("--max-requests", type=_at_least_one, default=DEFAULT_MAX_REQUESTS,
                   help="requests per open-loop workload at most; a trace with more loses its tail (the log says so)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="reuse the capacity and γ of an earlier results.json (skips both probes)")
    p.add_argument("--fixed-gamma", type=int, default=None, help="skip the batch-1 γ probe (quick mode uses 3)")
    p.add_argument("--drain-timeout-s", type=float, default=None, help="after the last arrival, cancel what is left after this")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench/UTC-STAMP)")
    p.add_argument("--plots-dir", type=Path, default=None, help="also copy the headline plots here (e.g. docs/bench)")
    p.add_argument("--repeats", type=int, default=1, help="repeat the policy sweep (interleaved) for the ratios' spread")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out that was stopped (same arguments): its calibration and every stack "
                        "that finished its workloads are kept, the one cut short runs again; a larger --repeats adds repeats")
    p.add_argument("--oracle", action="store_true",
                   help="after each repeat, also run the hindsight oracle: per workload, the best static table on the "
                        "surface that repeat measured (on by default with --headline)")
    p.add_argument("--recalibrate", action="store_true",
                   help="probe the capacity again before every repeat after the first and scale that repeat's loads to it "
                        "(γ stays the first calibration's), for a machine that drifts slowly between repeats; the 20 s probe "
                        "itself varies by ±15%% between repeats on a shared machine (BENCHMARKS.md)")
    p.add_argument("--record", action="store_true",
                   help="also write every run's engine steps to OUT/steps/, in the planner tests' replay format")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                   help="run nothing: merge earlier results.json files (each one a repeat) into one report and plots")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    with sigterm_stops_stacks():  # a bench killed with SIGTERM still stops the stacks it started
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    p = parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from nightjar_tools.bench.workload import LengthScale

    try:
        scale = LengthScale(prompt=a.prompt_scale, output=a.output_scale, max_output=a.max_output)
    except ValueError as exc:
        p.error(str(exc))
    if a.resume and (a.out is None or a.report or a.target):
        p.error("--resume continues a comparison in --out: give --out DIR, without --report or --target")
    out = a.out or Path("runs/bench") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if a.report:
        return _merge(a, p, out)
    if a.target:
        return _against_running(a, p, scale, out)
    return _compare(a, p, scale, out)


def _compare(a: argparse.Namespace, p: argparse.ArgumentParser, scale, out: Path) -> int:
    from nightjar_tools.bench import report
    from nightjar_tools.bench.compare import CompareConfig, ResumeError, run_comparison

    default_policies, default_workloads = ((QUICK_POLICIES, QUICK_WORKLOADS) if a.quick else
                                           (HEADLINE_POLICIES, HEADLINE_WORKLOADS) if a.headline else
                                           (FULL_POLICIES, FULL_WORKLOADS))
    policies = tuple(a.policies or default_policies)
    workloads = tuple(a.workloads or [_workload(w) for w in default_workloads])
    if a.headline and a.repeats == 1:
        a.repeats = 3
    fixed_gamma = a.fixed_gamma if a.fixed_gamma is not None else (3 if a.quick else None)
    capacity = a.capacity_rps
    if a.calibration is not None:
        from nightjar_tools.bench.compare import load_calibration

        try:
            cal = load_calibration(a.calibration)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--calibration {a.calibration}: {exc}")
        capacity = capacity or cal["capacity_rps"]
        fixed_gamma = fixed_gamma if a.fixed_gamma is not None else cal["fixed_gamma"]
    kv_budget = a.kv_budget_bytes
    draft_share = a.draft_share if a.draft_share is not None else HEADLINE_DRAFT_SHARE if a.headline else DEFAULT_DRAFT_SHARE
    if kv_budget is None and draft_share:
        from nightjar_tools.bench.compare import kv_budget_for_share

        try:
            kv_budget = kv_budget_for_share(draft_share, a.draft_model or paths.DEFAULT_DRAFT)
        except ValueError as exc:
            p.error(str(exc))
    worker = argparse.ArgumentParser(add_help=False)
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--dtype", default="float32")
    w = worker.parse_known_args(a.worker_arg)[0]
    prior = prior_surface(a.prior_surface, a.target_model, w.device)
    worker_args = tuple(a.worker_arg) + _prefill_args(a, p, w.device, w.dtype)
    try:
        cfg = CompareConfig(policies=policies, workloads=workloads, out_dir=out, seed=a.seed, scale=scale,
                            drain_timeout_s=a.drain_timeout_s or (15.0 if a.quick else 20.0), kv_budget_bytes=kv_budget,
                            worker_args=worker_args, planner_args=tuple(a.planner_arg), prior_surface=prior,
                            target_model=a.target_model, draft_model=a.draft_model,
                            worker_threads=a.worker_threads, capacity_rps=capacity, max_requests=a.max_requests,
                            fixed_gamma=fixed_gamma,
                            capacity_probe_s=12.0 if a.quick else 20.0, repeats=a.repeats, progress=not a.no_progress,
                            oracle=a.oracle or a.headline, recalibrate=a.recalibrate, record=a.record, resume=a.resume)
    except ValueError as exc:
        p.error(str(exc))
    t0 = time.monotonic()
    print(f"bench: KV budget {'engine default' if cfg.kv_budget_bytes is None else f'{cfg.kv_budget_bytes / 2**20:.1f} MiB'}",
          file=sys.stderr)
    try:
        cmp = run_comparison(cfg, log=lambda m: print(f"bench: {m}", file=sys.stderr, flush=True))
    except ResumeError as exc:  # raised before any stack starts
        p.error(str(exc))
    except (RuntimeError, TimeoutError) as exc:
        print(f"bench: the stack failed: {exc}", file=sys.stderr)
        return 1
    payload = cmp.payload()
    report.write_json(out / "results.json", payload)
    md = render(payload, time.monotonic() - t0)
    (out / "report.md").write_text(md)
    _plots(payload, out, a.plots_dir)
    print(md)
    print(f"bench: results in {out}", file=sys.stderr)
    return 0


def _prefill_args(a: argparse.Namespace, p: argparse.ArgumentParser, device: str, dtype: str) -> tuple[str, ...]:
    from worker.engine.linear import can_bf16_prefill

    native = can_bf16_prefill(device, dtype)
    choice = a.prefill_dtype or ("bfloat16" if a.headline and native else "float32")
    if choice == "bfloat16" and not native:
        p.error("--prefill-dtype bfloat16 needs float32 CPU workers on a CPU with AMX or AVX512-BF16")
    return ("--prefill-dtype=bfloat16",) if choice == "bfloat16" else ()


def _with_demand(run: dict, config: dict | None, capacity_rps: float) -> dict:
    """A run recorded before runs kept their trace's demand (``offered_tokens``): the traces are
    seeded, so rebuilding it from the run's config and capacity tells what it asked for."""
    if "offered_tokens" in run or run.get("kind") == "closed" or not config:
        return run
    from nightjar_tools.bench import report
    from nightjar_tools.bench.workload import LengthScale, build

    duration = dict((spec, d) for spec, d in config["workloads"]).get(run["workload"])
    if duration is None:
        return run
    wl = build(run["workload"], capacity_rps, duration, seed=config["seed"], scale=LengthScale(**config["scale"]),
               max_requests=config.get("max_requests", DEFAULT_MAX_REQUESTS))
    return {**run, **report.demand_of(wl)}


def merge_payloads(payloads: list[dict]) -> dict:
    """Earlier comparisons as repeats of one: runs renumbered, goals recomputed across them.

    They must share the calibration (``--calibration`` of the first), or their workloads differ,
    unless each was run with ``--recalibrate``: then every repeat had its own capacity anyway, and
    its ratios pair runs at the same load."""
    from nightjar_tools.bench import report

    first = payloads[0]
    caps = {round(pl["calibration"]["capacity_rps"], 6) for pl in payloads}
    if len(caps) > 1 and not all("recalibrated" in pl["calibration"] for pl in payloads):
        raise ValueError(f"the results were run at different capacities {sorted(caps)}: rerun with --calibration FIRST/results.json")
    runs, samples, capacities, rep = [], {}, {}, 0
    for pl in payloads:
        reps = sorted({r.get("repeat", 0) for r in pl["runs"]})
        for k in reps:
            capacities[str(rep)] = pl["calibration"].get("recalibrated", {}).get(str(k), pl["calibration"]["capacity_rps"])
            for r in pl["runs"]:
                if r.get("repeat", 0) == k:
                    runs.append(_with_demand({**r, "repeat": rep}, pl.get("config"), capacities[str(rep)]))
            rep += 1
        for key, s in pl["samples"].items():
            policy, workload, _ = report.parse_sample_key(key)
            samples.setdefault(report.sample_key(policy, workload, 0), s)  # timelines of the first repeat
    kinds = {r["workload"]: r["kind"] for r in runs}
    merged = {**first, "runs": runs, "samples": samples, "merged_from": rep}
    if any("recalibrated" in pl["calibration"] for pl in payloads):
        merged["calibration"] = {**first["calibration"], "recalibrated": capacities}
    merged["goals"] = report.goal_rows(runs, kinds) + report.learning_rows(merged)
    return merged


def _merge(a: argparse.Namespace, p: argparse.ArgumentParser, out: Path) -> int:
    import json

    from nightjar_tools.bench import report

    try:
        payloads = [json.loads(path.read_text()) for path in a.report]
        payload = merge_payloads(payloads)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--report: {exc}")
    report.write_json(out / "results.json", payload)
    md = render(payload)
    (out / "report.md").write_text(md)
    _plots(payload, out, a.plots_dir)
    print(md)
    print(f"bench: merged {len(a.report)} result files in {out}", file=sys.stderr)
    return 0


def render(payload: dict, wall_s: float | None = None) -> str:
    from nightjar_tools.bench import report

    cal = payload["calibration"]
    lines = [f"Capacity (γ = 0, saturated): {cal['capacity_rps']:.3f} req/s; best γ at batch 1: {cal['fixed_gamma']}."]
    if cal.get("gamma_probe"):
        lines.append("\n| γ | batch-1 tokens/s | acceptance |\n|---|---|---|")
        for g, row in sorted(cal["gamma_probe"].items(), key=lambda kv: int(kv[0])):
            acc = row.get("acceptance")
            lines.append(f"| {g} | {row['tokens_per_s']:.1f} | {'–' if acc is None else f'{acc:.2f}'} |")
    if cal.get("recalibrated"):
        lines.append("\nRecalibrated before each repeat, req/s: " +
                     ", ".join(f"{c:.3f}" for _, c in sorted(cal["recalibrated"].items(), key=lambda kv: int(kv[0]))) + ".")
    for note in cal.get("notes", []):
        lines.append(f"\nNote: {note}")
    lines += ["", report.markdown_summary(payload["runs"]), report.markdown_goals(payload["goals"]),
              "", "Every run:", "", report.markdown_runs(payload["runs"])]
    if wall_s is not None:
        lines.append(f"\nWall time {wall_s / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def _plots(payload: dict, out: Path, plots_dir: Path | None) -> None:
    from nightjar_tools.bench import plots, report

    cap = payload["calibration"]["capacity_rps"]
    made = []
    for key, samples in payload["samples"].items():
        policy, workload, rep = report.parse_sample_key(key)
        if rep:  # timelines of the first repeat only
            continue
        name = f"timeline_{_slug(policy)}_{_slug(workload)}.png"
        made.append((policy, plots.timeline(samples, out / "plots" / name, f"{policy} — {workload}", cap)))
    policies = [r["policy"] for r in payload["runs"]]
    base = next((p for p in policies if p.startswith("fixed")), policies[0] if policies else None)
    # Raw runs: the chart averages repeats itself and shows their spread.
    bars = plots.comparison_bars(payload["runs"], out / "plots" / "comparison.png", base, "Policies on the real stack") if base else None
    if plots_dir is not None:
        plots_dir.mkdir(parents=True, exist_ok=True)
        for policy, path in made:
            if policy.split(":", 1)[0] in HEADLINE_TIMELINES:
                shutil.copy(path, plots_dir / path.name)
        if bars:
            shutil.copy(bars, plots_dir / bars.name)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


def _against_running(a: argparse.Namespace, p: argparse.ArgumentParser, scale, out: Path) -> int:
    from nightjar_tools.bench import plots, report
    from nightjar_tools.bench.loadgen import LoadConfig, run_load
    from nightjar_tools.bench.probe import StackProbe, summarize_steps
    from nightjar_tools.bench.workload import PromptBank, build

    if a.capacity_rps is None:
        p.error("--target needs --capacity-rps (the stack's saturated request rate; a compare run measures it)")
    workloads = a.workloads or [_workload(w) for w in (QUICK_WORKLOADS if a.quick else FULL_WORKLOADS)]
    bank = PromptBank()
    runs, samples = [], {}

    async def go() -> None:
        for plan in workloads:
            wl = build(plan.spec, a.capacity_rps, plan.duration_s, seed=a.seed, scale=scale, max_requests=a.max_requests)
            probe = StackProbe(a.redis_url, a.key_prefix) if a.redis_url else None
            if probe:
                await probe.start()
            cfg = LoadConfig(target=a.target, max_duration_s=plan.duration_s, drain_timeout_s=a.drain_timeout_s or 30.0,
                             seed=a.seed, progress=not a.no_progress, label=plan.spec)
            try:
                res = await run_load(wl, bank.texts(wl, a.seed), cfg, probe=probe)
                steps = None
                if probe:
                    await probe.read_steps()
                    steps = summarize_steps(probe.steps, (res.started_unix + wl.warmup_s) * 1000)
            finally:
                if probe:
                    await probe.close()
            run = report.summarize_workload(res, steps, wl)
            run.update(policy="(running stack)", kind=plan.kind)
            runs.append(run)
            samples[f"(running stack)|{plan.spec}"] = res.samples

    asyncio.run(go())
    payload = {"calibration": {"capacity_rps": a.capacity_rps, "fixed_gamma": a.fixed_gamma or 0}, "runs": runs, "goals": [],
               "samples": samples}
    report.write_json(out / "results.json", payload)
    for key, s in samples.items():
        plots.timeline(s, out / "plots" / f"timeline_{_slug(key)}.png", key, a.capacity_rps)
    print(report.markdown_runs(runs))
    print(f"bench: results in {out}", file=sys.stderr)
    return 0
