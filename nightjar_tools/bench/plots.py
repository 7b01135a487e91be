"""Plots: a timeline per run and a bar chart of the headline comparison (matplotlib, PNG).

The timeline stacks, on one time axis, what a person needs to see at a glance: the offered
load rising, the batch filling, γ falling to 0 as it does, the draft leaving the device and the
KV cache growing into its space, and what that does to tokens/s and latency.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402

RESIDENCY_LEVEL = {"resident": 1.0, "reloading": 0.5, "offloading": 0.5, "offloaded": 0.0, "none": float("nan")}


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in samples:
        v = s.get(key)
        if v is not None:
            xs.append(s["t"])
            ys.append(v)
    return xs, ys


def timeline(samples: list[dict], path: Path, title: str, capacity_rps: float | None = None) -> Path:
    """One PNG with seven stacked panels sharing the time axis."""
    fig, axes = plt.subplots(7, 1, figsize=(9, 13), sharex=True, constrained_layout=True)
    ax = axes[0]
    ax.plot(*_series(samples, "offered_rps"), color="tab:blue", label="arrivals (5 s window)")
    xs, ys = _series(samples, "nominal_rps")
    if xs:
        ax.step(xs, ys, where="post", color="tab:blue", ls=":", lw=1, label="pattern")
    if capacity_rps:
        ax.axhline(capacity_rps, color="grey", ls="--", lw=1, label="measured capacity")
    ax.set_ylabel("load\n(req/s)")
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[1]
    ax.plot(*_series(samples, "running"), color="tab:green", label="running (heartbeat)")
    ax.plot(*_series(samples, "batch"), color="tab:olive", lw=0.8, label="decode batch (steps)")
    ax.plot(*_series(samples, "waiting"), color="tab:red", lw=0.8, label="waiting")
    ax.set_ylabel("sequences")
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[2]
    xs, ys = _series(samples, "gamma")
    if not xs:
        xs, ys = _series(samples, "gamma_hb")
    ax.step(xs, ys, where="post", color="tab:purple")
    ax.set_ylabel("γ in force")
    ax.set_ylim(bottom=-0.2)
    ax = axes[3]
    xs, ys = _series(samples, "residency")
    ax.step(xs, [RESIDENCY_LEVEL.get(y, float("nan")) for y in ys], where="post", color="tab:brown")
    ax.set_yticks([0, 0.5, 1], ["offloaded", "moving", "resident"])
    ax.set_ylim(-0.2, 1.2)
    ax.set_ylabel("draft")
    ax = axes[4]
    xt, total = _series(samples, "kv_blocks_total")
    ax.plot(xt, total, color="tab:cyan", label="KV blocks total")
    used = [(s["t"], s["kv_blocks_total"] - s["kv_blocks_free"]) for s in samples
            if s.get("kv_blocks_total") is not None and s.get("kv_blocks_free") is not None]
    if used:
        ax.plot([u[0] for u in used], [u[1] for u in used], color="tab:gray", lw=0.8, label="used")
    ax.set_ylabel("KV blocks")
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[5]
    ax.plot(*_series(samples, "tokens_per_s"), color="tab:orange")
    ax.set_ylabel("output\ntokens/s")
    ax = axes[6]
    ax.plot(*_series(samples, "e2e_s"), ".", ms=3, color="tab:red", label="e2e (finished in window)")
    ax.plot(*_series(samples, "ttft_s"), ".", ms=3, color="tab:blue", label="TTFT")
    ax.set_ylabel("latency (s)")
    ax.set_xlabel("time (s)")
    ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _ratios(runs: list[dict], baseline: str, key: str) -> dict[tuple[str, str], list[float]]:
    """Every repeat's value ÷ ``baseline``'s in the same repeat on the same workload (the goals'
    paired ratios: repeats may differ in load, with ``--recalibrate``, or in the machine's speed),
    or ÷ the mean of its repeats where it did not run in that one."""
    def value(r: dict) -> float | None:
        return r["tokens_per_s"] if key == "tokens_per_s" else r["e2e_s"]["mean"]

    groups: dict[tuple[str, str], list[tuple[int | None, float]]] = {}
    for r in runs:
        v = value(r)
        if v is not None:
            groups.setdefault((r["policy"], r["workload"]), []).append((r.get("repeat"), v))
    out = {}
    for (pol, wl), vals in groups.items():
        base = groups.get((baseline, wl), [])
        total = sum(v for _, v in base)
        if total > 0:
            same = {rep: v for rep, v in base if rep is not None and v > 0}
            out[(pol, wl)] = [v / same.get(rep, total / len(base)) for rep, v in vals]
    return out


def comparison_figure(runs: list[dict], baseline: str, title: str):
    """The figure of ``comparison_bars``: grouped bars per workload, every policy ÷ ``baseline``.

    ``runs`` are the raw runs, repeats included: a bar is the median of the paired ratios over
    repeats (as in the goals table) and its whisker their min–max. Bars start at 1 (the baseline)
    and the y-axis is fitted to the data, not to 0, so a ±10% difference is a tenth of the axis
    rather than a sliver on a bar of height 1. The legend sits under the panels, never on a bar
    or the title.
    """
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    counts = [len(v) for v in _ratios(runs, baseline, "tokens_per_s").values()] or [1]
    repeats = str(max(counts)) if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}"
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(workloads) + 3), 7.5), layout="constrained")
    width = 0.8 / max(len(policies), 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, label in ((axes[0], "tokens_per_s", "throughput ÷ baseline\n(higher is better)"),
                           (axes[1], "e2e_mean", "mean e2e latency ÷ baseline\n(lower is better)")):
        ratios = _ratios(runs, baseline, key)
        lo, hi = 1.0, 1.0
        for i, pol in enumerate(policies):
            xs, mids, err_lo, err_hi = [], [], [], []
            for j, wl in enumerate(workloads):
                vals = ratios.get((pol, wl))
                if not vals:
                    continue
                mid = statistics.median(vals)
                xs.append(j + i * width)
                mids.append(mid)
                err_lo.append(mid - min(vals))
                err_hi.append(max(vals) - mid)
                lo, hi = min(lo, min(vals)), max(hi, max(vals))
            color = colors[i % len(colors)]
            ax.bar(xs, [m - 1.0 for m in mids], width, bottom=1.0, color=color, label=pol)
            if any(err_lo) or any(err_hi):
                ax.errorbar(xs, mids, yerr=[err_lo, err_hi], fmt="none", ecolor="black", elinewidth=1, capsize=3)
            for x, m, e in zip(xs, mids, err_hi):
                ax.annotate(f"{(m - 1) * 100:+.0f}%", (x, m + e if m >= 1 else m - e), ha="center",
                            va="bottom" if m >= 1 else "top", fontsize=7, xytext=(0, 2 if m >= 1 else -2),
                            textcoords="offset points")
        pad = max(0.05, 0.15 * (hi - lo))  # room for the labels; ±5% at least, so 1.0 is never an edge
        ax.set_ylim(lo - pad, hi + pad)
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", color="0.9", lw=0.8)
        ax.set_axisbelow(True)
    whiskers = f"; whiskers: min–max of {repeats} repeats" if max(counts) > 1 else ""
    fig.suptitle(f"{title} (baseline: {baseline}{whiskers})", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(6, max(1, len(policies))), fontsize=8,
               frameon=False)
    return fig


def comparison_bars(runs: list[dict], path: Path, baseline: str, title: str) -> Path:
    """``comparison_figure`` written to ``path`` (PNG)."""
    fig = comparison_figure(runs, baseline, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
