"""Report: per-run metrics from the load generator's records, the JSON file, the markdown tables,
and the headline ratios checked against the project's goals.

Throughput is output tokens delivered ÷ makespan (first send to last completion, as vLLM's
``benchmark_serving`` measures it), so under an identical open-loop arrival schedule a policy
that keeps up finishes sooner. A closed loop's is the steady rate instead: tokens the clients
received while all C were sending (``steady_tokens_per_s``); the makespan rate stays beside it.
Latencies are client-side (the gRPC stream as a user sees it). Inter-token latency is per
request (last token − first token) ÷ (tokens − 1), then averaged.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from pathlib import Path

from nightjar_tools.bench.loadgen import LoadResult


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float]) -> dict:
    xs = [v for v in values if v is not None]
    return {"mean": sum(xs) / len(xs) if xs else None, "p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}


def steady_tokens_per_s(samples: list[dict], start_s: float, end_s: float) -> float | None:
    """Output tokens per second the client received between ``start_s`` and ``end_s``, from the
    sampler's per-interval rates (the cumulative count interpolated linearly at both ends); None
    when the samples do not span the window."""
    if end_s <= start_s or not samples:
        return None
    ts, cum, prev_t, total = [0.0], [0.0], 0.0, 0.0
    for row in samples:  # tokens_per_s covers (previous sample, this one]
        total += row["tokens_per_s"] * (row["t"] - prev_t)
        prev_t = row["t"]
        ts.append(row["t"])
        cum.append(total)
    if ts[-1] < end_s:
        return None

    def at(t: float) -> float:
        i = max(bisect.bisect_left(ts, t), 1)
        w = (t - ts[i - 1]) / max(ts[i] - ts[i - 1], 1e-9)
        return cum[i - 1] + w * (cum[i] - cum[i - 1])
    return (at(end_s) - at(start_s)) / (end_s - start_s)


def summarize(result: LoadResult, step_summary: dict | None = None, warmup_s: float = 0.0,
              steady_until_s: float | None = None) -> dict:
    """warmup_s: requests sent before it are left out (a closed loop's warm-up); the makespan
    then starts at warmup_s. steady_until_s (a closed loop's end of sending): ``tokens_per_s``
    is then the steady rate over [warmup_s, steady_until_s], not tokens ÷ makespan. A closed
    loop's makespan ends with a drain in which the batch dwindles, over the length of a request
    when the requests finish at different steps (speculation, whose acceptance varies) and not at
    all when they finish together (γ = 0 with fixed-length requests): a drain-inclusive rate
    charges that difference, which is not the load at C clients, to speculation (BENCHMARKS.md,
    the live planner)."""
    recs = [r for r in result.records if r.status == "not_sent" or r.sent_s >= warmup_s]
    ok = [r for r in recs if r.ok]
    sent = [r for r in recs if r.status != "not_sent"]
    tokens = sum(r.completion_tokens for r in sent)
    start = warmup_s if warmup_s > 0 else min((r.sent_s for r in sent), default=0.0)
    end = max((r.end_s for r in sent if r.end_s is not None), default=result.wall_s)
    if any(not r.ok for r in sent):  # cut off by the drain bound: the run lasted until the cut
        end = max(end, result.wall_s)
    makespan = max(end - start, 1e-9)
    lag = [r.sent_s - r.planned_s for r in sent]
    out = {
        "label": result.label, "workload": result.workload, "requests": len(recs), "sent": len(sent), "ok": len(ok),
        "failed": {s: sum(r.status == s for r in sent) for s in sorted({r.status for r in sent if not r.ok})},
        "output_tokens": tokens, "makespan_s": makespan,
        "tokens_per_s": tokens / makespan, "requests_per_s": len(ok) / makespan,
        "makespan_tokens_per_s": tokens / makespan,
        "ttft_s": stats([r.ttft_s for r in ok]), "itl_s": stats([r.itl_s for r in ok]), "e2e_s": stats([r.e2e_s for r in ok]),
        "send_lag_s": stats(lag),
        "errors": sorted({f"{r.status}: {r.error}" for r in sent if not r.ok and r.error})[:5],
    }
    if steady_until_s is not None:
        steady = steady_tokens_per_s(result.samples, warmup_s, steady_until_s)
        if steady is not None:
            out["tokens_per_s"] = out["steady_tokens_per_s"] = steady
    if step_summary is not None:
        out["engine"] = step_summary
    return out


def summarize_workload(result: LoadResult, step_summary: dict | None, wl) -> dict:
    """``summarize`` for a run of ``wl`` (a ``Workload``): its warm-up left out, and a closed
    loop's throughput taken over the window in which all its clients were sending. An open loop's
    run also keeps what the trace offered (``offered_tokens`` over ``offered_span_s``, first to last
    arrival): no policy's tokens/s can exceed their quotient (``demand_ceiling``)."""
    out = summarize(result, step_summary, warmup_s=wl.warmup_s, steady_until_s=wl.duration_s if wl.clients else None)
    return {**out, **demand_of(wl)}


def demand_of(wl) -> dict:
    """An open-loop ``Workload``'s ``offered_tokens`` and ``offered_span_s``; {} for a closed loop
    (its demand follows its service) or a single request (no span)."""
    if wl.clients or len(wl) < 2:
        return {}
    return {"offered_tokens": int(wl.output_tokens.sum()), "offered_span_s": float(wl.arrival_s[-1] - wl.arrival_s[0])}


def demand_ceiling(run: dict) -> float | None:
    """Output tokens/s no policy can beat on this run's trace: every request is sent at its arrival
    and asks for a fixed number of tokens (ignore_eos), so the makespan is at least the arrivals'
    span and the tokens at most what they asked for. None where the run did not record it."""
    span = run.get("offered_span_s")
    return run["offered_tokens"] / span if span else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# --------------------------------------------------------------------------- goals

STATIC_BEST = "best-static"  # baseline: the best of `off` and every `fixed:γ`, per repeat
ORACLE = "oracle"  # the hindsight table: each bucket's best γ on the repeat's measured surface
ORACLE_MIN_STEPS = 20  # a (bucket, γ) cell with fewer decode steps is too noisy to choose by

# (name, workloads it applies to, baseline chooser, metric, direction, threshold)
# direction "ge": nightjar / baseline >= threshold; "le": <= threshold.
GOALS = (
    ("throughput vs fixed-γ (dynamic)", "dynamic", "fixed", "tokens_per_s", "ge", 1.27),
    ("mean e2e latency vs fixed-γ (dynamic)", "dynamic", "fixed", "e2e_mean", "le", 0.80),
    ("throughput vs threshold (dynamic)", "dynamic", "threshold", "tokens_per_s", "ge", 1.05),
    ("throughput vs table (dynamic)", "dynamic", "table", "tokens_per_s", "ge", 1.05),
    ("throughput vs ema (dynamic)", "dynamic", "ema", "tokens_per_s", "ge", 1.05),
    ("throughput vs heuristic (dynamic)", "dynamic", "heuristic", "tokens_per_s", "ge", 1.05),
    ("throughput vs fixed-γ (steady low)", "low", "fixed", "tokens_per_s", "ge", 0.95),
    ("mean e2e latency vs fixed-γ (steady low)", "low", "fixed", "e2e_mean", "le", 1 / 0.95),
    ("throughput vs off (steady overload)", "overload", "off", "tokens_per_s", "ge", 0.97),
    ("TTFT p50, offload vs no offload (overload)", "overload", "nightjar-nooffload", "ttft_p50", "le", 0.70),
    # A dynamic trace's peaks overload the stack too, and there the draft leaves mid-run.
    ("TTFT p50, offload vs no offload (dynamic)", "dynamic", "nightjar-nooffload", "ttft_p50", "le", 0.70),
    ("throughput vs best static γ (closed loop)", "closed", STATIC_BEST, "tokens_per_s", "ge", 0.97),
    ("throughput vs best static γ (dynamic)", "dynamic", STATIC_BEST, "tokens_per_s", "ge", 1.00),
    ("throughput vs hindsight oracle (dynamic)", "dynamic", ORACLE, "tokens_per_s", "ge", 0.95),
)


def metric(run: dict, name: str) -> float | None:
    if name == "tokens_per_s":
        return run["tokens_per_s"]
    if name == "e2e_mean":
        return run["e2e_s"]["mean"]
    if name == "ttft_p50":
        return run["ttft_s"]["p50"]
    raise ValueError(f"unknown metric {name!r}")


def _is_static(policy: str) -> bool:
    return policy == "off" or policy.startswith("fixed:")


def pool_cells(cell_maps) -> dict[str, list[float]]:
    """Engine cells ("bucket|γ" -> [steps, ms, emitted tokens]) of several runs, summed per cell;
    a run without cells (None) adds nothing."""
    pooled: dict[str, list[float]] = {}
    for cells in cell_maps:
        for key, (steps, ms, tokens) in (cells or {}).items():
            cell = pooled.setdefault(key, [0, 0.0, 0])
            cell[0] += steps
            cell[1] += ms
            cell[2] += tokens
    return pooled


def oracle_table(runs: list[dict], min_steps: int = ORACLE_MIN_STEPS) -> dict[int, int]:
    """The best static per-batch-size table in hindsight: {bucket upper bound: γ}.

    ``runs``: one workload's runs of one repeat, every policy. Their engines' pure decode steps
    (``engine["cells"]``: "bucket|γ" -> [steps, ms, emitted tokens]) pooled per cell make the
    run's measured surface; each bucket takes the γ with the fewest ms per emitted token among
    cells with ``min_steps`` or more. Only γs some policy played in a bucket can be chosen there.
    """
    best: dict[int, tuple[float, int]] = {}
    for key, (steps, ms, tokens) in pool_cells((r.get("engine") or {}).get("cells") for r in runs).items():
        bucket, gamma = (int(x) for x in key.split("|"))
        if steps >= min_steps and tokens > 0:
            cost = ms / tokens
            if bucket not in best or cost < best[bucket][0]:
                best[bucket] = (cost, gamma)
    return {b: best[b][1] for b in sorted(best)}


def learning_delays(samples: dict[str, list[dict]], subject: str = "nightjar", baselines: tuple[str, ...] = (),
                    window_s: float = 10.0, horizon_s: float = 60.0, target: float = 0.95) -> list[dict]:
    """How soon after each change of the pattern's load the subject's throughput catches up.

    ``samples``: one workload's timelines by policy (loadgen samples: ``t``, ``tokens_per_s``,
    ``nominal_rps``). At every change of ``nominal_rps`` the phase's baseline is whichever of
    ``baselines`` delivered the most tokens over the phase; the delay is the first sample within
    ``horizon_s`` at which the subject's rolling ``window_s`` throughput reaches ``target`` × the
    baseline's over the same window (None: not within the horizon). A phase shorter than the
    window cannot be judged (``judged`` False): the oscillation's 40 pieces last 3 s in a 120 s
    run, and every one of them once read as a miss."""
    sub = samples.get(subject) or []
    base = {p: samples[p] for p in baselines if samples.get(p)}
    if not sub or not base:
        return []
    changes = [(b["t"], b["nominal_rps"]) for a, b in zip(sub, sub[1:])
               if a.get("nominal_rps") is not None and b.get("nominal_rps") is not None and a["nominal_rps"] != b["nominal_rps"]]
    ends = [t for t, _ in changes[1:]] + [sub[-1]["t"]]

    def rate(series: list[dict], t0: float, t1: float) -> float:
        xs = [x["tokens_per_s"] for x in series if t0 < x["t"] <= t1]
        return sum(xs) / len(xs) if xs else 0.0

    out = []
    for (t_change, rps), t_end in zip(changes, ends):
        if t_end - t_change < window_s:
            out.append({"t": t_change, "nominal_rps": rps, "baseline": None, "delay_s": None, "judged": False})
            continue
        best = max(base, key=lambda p: rate(base[p], t_change, t_end))
        delay = None
        for x in sub:
            t = x["t"]
            if t_change + window_s <= t <= min(t_change + horizon_s, t_end):
                ref = rate(base[best], t - window_s, t)
                if ref <= 0 or rate(sub, t - window_s, t) >= target * ref:
                    delay = t - t_change
                    break
        out.append({"t": t_change, "nominal_rps": rps, "baseline": best, "delay_s": delay, "judged": True})
    return out


def _baseline(policies: list[str], kind: str) -> str | None:
    if kind == STATIC_BEST:
        return STATIC_BEST if any(_is_static(p) for p in policies) else None
    if kind in policies:
        return kind
    return next((p for p in policies if p.split(":", 1)[0] == kind), None)


def goal_rows(runs: list[dict], workload_kinds: dict[str, str], subject: str = "nightjar") -> list[dict]:
    """One row per (goal, workload): nightjar's ratio to the goal's baseline and whether it met it.

    With repeats (``run["repeat"]``), the ratio is taken within each repeat (both runs measured
    back to back under the same machine load) and the row gives their median, min and max; the
    verdict is on the median (one noisy repeat does not carry it).
    """
    by = {(r["policy"], r["workload"], r.get("repeat", 0)): r for r in runs}
    policies = sorted({r["policy"] for r in runs})
    repeats = sorted({r.get("repeat", 0) for r in runs})
    for wl in workload_kinds:  # the best static policy of each (workload, repeat) by throughput
        for k in repeats:
            static = [by[(p, wl, k)] for p in policies if _is_static(p) and (p, wl, k) in by]
            if static:
                by[(STATIC_BEST, wl, k)] = max(static, key=lambda r: r["tokens_per_s"])
    rows = []
    for name, kind, base_kind, met, direction, threshold in GOALS:
        base = _baseline(policies, base_kind)
        for wl, wl_kind in workload_kinds.items():
            if wl_kind != kind or base is None:
                continue
            ratios = [ratio(metric(by[(subject, wl, k)], met), metric(by[(base, wl, k)], met))
                      for k in repeats if (subject, wl, k) in by and (base, wl, k) in by]
            ratios = [x for x in ratios if x is not None]
            if not ratios:
                continue
            r = statistics.median(ratios)
            ok = r >= threshold if direction == "ge" else r <= threshold
            note = ""
            if met == "tokens_per_s":
                ceilings = [ratio(demand_ceiling(by[(subject, wl, k)]), metric(by[(base, wl, k)], met))
                            for k in repeats if (subject, wl, k) in by and (base, wl, k) in by]
                cap = statistics.median(ceilings) if ceilings and None not in ceilings else None
                if cap is not None and cap < threshold:
                    # The trace asks for less than the goal: report it, the verdict stands.
                    note = f"unreachable: the trace's demand caps any policy at {cap:.3f}×"
            if base_kind == "nightjar-nooffload":
                # The offload goal is about offload: a difference without one is noise, not a result.
                offloads = sum((by[(subject, wl, k)].get("engine") or {}).get("offloads", 0) for k in repeats if (subject, wl, k) in by)
                if offloads == 0:
                    ok, note = None, "not exercised: no offload happened"
            rows.append({"goal": name, "workload": wl, "baseline": base, "ratio": r, "ratios": ratios,
                         "target": f"{'≥' if direction == 'ge' else '≤'} {threshold:.2f}", "met": ok, "note": note})
    return rows


def sample_key(policy: str, workload: str, rep: int) -> str:
    """A run's timeline key in ``samples``: "policy|workload", with "|rN" after the first repeat."""
    return f"{policy}|{workload}" + (f"|r{rep}" if rep else "")


def parse_sample_key(key: str) -> tuple[str, str, int]:
    """``sample_key``'s inverse: -> (policy, workload, repeat)."""
    policy, workload, *rep = key.split("|")
    return policy, workload, int(rep[0][1:]) if rep else 0


def learning_rows(payload: dict, horizon_s: float = 60.0) -> list[dict]:
    """The learning-speed goal per dynamic workload: the share of load changes after which
    nightjar reached 0.95x the best static policy's (or the oracle's) rolling throughput within
    ``horizon_s`` (first repeat's timelines)."""
    runs = payload["runs"]
    policies = sorted({r["policy"] for r in runs})
    baselines = tuple(p for p in policies if _is_static(p) or p == ORACLE)
    rows = []
    for wl in dict.fromkeys(r["workload"] for r in runs if r["kind"] == "dynamic"):
        timelines = {}  # policy -> its first repeat's timeline on wl
        for key, s in payload["samples"].items():
            policy, workload, rep = parse_sample_key(key)
            if workload == wl and rep == 0:
                timelines[policy] = s
        delays = learning_delays(timelines, baselines=baselines, horizon_s=horizon_s)
        judged = [d for d in delays if d["judged"]]
        goal = f"learning: ≥ 0.95× best static within {horizon_s:.0f} s of a load change"
        short = len(delays) - len(judged)
        if not judged:
            if delays:
                rows.append({"goal": goal, "workload": wl, "baseline": "best static per phase", "ratio": None, "ratios": [],
                             "target": "every change", "met": None,
                             "note": f"not judged: all {short} phases are shorter than the window"})
            continue
        reached = [d["delay_s"] for d in judged if d["delay_s"] is not None]
        note = "; ".join(x for x in (f"median delay {statistics.median(reached):.0f} s" if reached else "",
                                     f"{short} phases shorter than the window not judged" if short else "") if x)
        rows.append({"goal": goal, "workload": wl, "baseline": "best static per phase", "ratio": len(reached) / len(judged),
                     "ratios": [], "target": f"all {len(judged)} changes", "met": len(reached) == len(judged), "note": note})
    return rows


def average_runs(runs: list[dict]) -> list[dict]:
    """One run per (policy, workload) with throughput and mean e2e averaged over repeats (for the bar chart)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["policy"], r["workload"]), []).append(r)
    out = []
    for (policy, wl), rs in groups.items():
        e2e = [r["e2e_s"]["mean"] for r in rs if r["e2e_s"]["mean"] is not None]
        out.append({"policy": policy, "workload": wl, "tokens_per_s": sum(r["tokens_per_s"] for r in rs) / len(rs),
                    "e2e_s": {"mean": sum(e2e) / len(e2e) if e2e else None}, "repeats": len(rs)})
    return out


# --------------------------------------------------------------------------- rendering


def _f(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def markdown_runs(runs: list[dict]) -> str:
    head = ("| workload | policy | rep | ok/sent | tok/s | req/s | TTFT mean / p50 / p99 (s) | ITL mean / p50 / p99 (ms) "
            "| e2e mean / p50 / p99 (s) | γ switches | offloads | acceptance | mean batch | prefill share | load avg "
            "| speed probe (ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        e = r.get("engine") or {}
        t, i, e2e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r.get('repeat', 0) + 1} | {r['ok']}/{r['sent']} | {_f(r['tokens_per_s'], 1)} | {_f(r['requests_per_s'], 3)} "
            f"| {_f(t['mean'])} / {_f(t['p50'])} / {_f(t['p99'])} | {_f(i['mean'], 0, 1e3)} / {_f(i['p50'], 0, 1e3)} / {_f(i['p99'], 0, 1e3)} "
            f"| {_f(e2e['mean'])} / {_f(e2e['p50'])} / {_f(e2e['p99'])} | {e.get('gamma_switches', '–')} | {e.get('offloads', '–')} "
            f"| {_f(e.get('acceptance'))} | {_f(e.get('mean_batch'), 1)} | {_f(e.get('prefill_share'))} | {_f(r.get('loadavg_1m'), 1)} "
            f"| {_f(r.get('speed_probe_ms'), 1)} |")
    return "\n".join(lines)


def _mean_range(values: list[float | None], digits: int, scale: float = 1.0) -> str:
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return "–"
    mean = sum(xs) / len(xs)
    return f"{mean:.{digits}f}" if len(xs) == 1 else f"{mean:.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def markdown_summary(runs: list[dict]) -> str:
    """One table per workload, one row per policy: means over repeats, (min–max) when repeated."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in runs):
        rows = [r for r in runs if r["workload"] == wl]
        d = next((r for r in rows if demand_ceiling(r) is not None), None)
        demand = (f" (the trace asks for {d['offered_tokens']:,} tokens over {d['offered_span_s']:.1f} s: "
                  f"no policy exceeds {demand_ceiling(d):.1f} tok/s)" if d is not None else "")
        out += [f"**{wl}**{demand}", "",
                "| policy | ok/sent | output tok/s | req/s | TTFT p50 (s) | ITL mean (ms) | e2e mean (s) | e2e p99 (s) "
                "| γ switches | offloads | acceptance | mean batch | prefill share |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for pol in dict.fromkeys(r["policy"] for r in rows):
            rs = [r for r in rows if r["policy"] == pol]
            eng = [r.get("engine") or {} for r in rs]
            out.append(
                f"| {pol} | {sum(r['ok'] for r in rs)}/{sum(r['sent'] for r in rs)} | {_mean_range([r['tokens_per_s'] for r in rs], 1)} "
                f"| {_mean_range([r['requests_per_s'] for r in rs], 2)} | {_mean_range([r['ttft_s']['p50'] for r in rs], 2)} "
                f"| {_mean_range([r['itl_s']['mean'] for r in rs], 0, 1e3)} | {_mean_range([r['e2e_s']['mean'] for r in rs], 2)} "
                f"| {_mean_range([r['e2e_s']['p99'] for r in rs], 2)} | {_mean_range([e.get('gamma_switches') for e in eng], 0)} "
                f"| {sum(e.get('offloads', 0) for e in eng)} | {_mean_range([e.get('acceptance') for e in eng], 2)} "
                f"| {_mean_range([e.get('mean_batch') for e in eng], 1)} | {_mean_range([e.get('prefill_share') for e in eng], 2)} |")
        out.append("")
    return "\n".join(out)


def markdown_goals(rows: list[dict]) -> str:
    lines = ["| goal | workload | baseline | nightjar ÷ baseline | target | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = r.get("note") or "–" if r["met"] is None else ("met" if r["met"] else "**missed**")
        if r["met"] is not None and r.get("note"):
            verdict += f" ({r['note']})"
        value = _f(r["ratio"], 3)
        if len(r.get("ratios", ())) > 1:
            value += f" ({min(r['ratios']):.3f}–{max(r['ratios']):.3f}, {len(r['ratios'])} repeats)"
        lines.append(f"| {r['goal']} | {r['workload']} | {r['baseline']} | {value} | {r['target']} | {verdict} |")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable))


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serializable: {type(x).__name__}")
