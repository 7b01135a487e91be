"""Plots: a timeline per run and a bar chart of the headline comparison (matplotlib, PNG).

The timeline stacks, on one time axis, what a person needs to see at a glance: the offered
load rising, the batch filling, γ falling to 0 as it does, the draft leaving the device and the
KV cache growing into its space, and what that does to tokens/s and latency.
"""

from __future__ import annotations

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


def comparison_bars(runs: list[dict], path: Path, baseline: str, title: str) -> Path:
    """Grouped bars per workload: throughput and mean e2e latency of every policy ÷ ``baseline``'s."""
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {(r["policy"], r["workload"]): r for r in runs}
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(workloads) + 3), 7), constrained_layout=True)
    width = 0.8 / max(len(policies), 1)
    for ax, key, label in ((axes[0], "tokens_per_s", "throughput ÷ baseline (higher is better)"),
                           (axes[1], "e2e_mean", "mean e2e latency ÷ baseline (lower is better)")):
        for i, pol in enumerate(policies):
            vals = []
            for wl in workloads:
                run, base = by.get((pol, wl)), by.get((baseline, wl))
                a = b = None
                if run and base:
                    a, b = (run["tokens_per_s"], base["tokens_per_s"]) if key == "tokens_per_s" else (run["e2e_s"]["mean"], base["e2e_s"]["mean"])
                vals.append(a / b if a is not None and b else 0.0)
            ax.bar([j + i * width for j in range(len(workloads))], vals, width, label=pol)
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel(label, fontsize=8)
    axes[0].legend(fontsize=7, ncol=min(4, len(policies)), loc="lower right")
    fig.suptitle(f"{title} (baseline: {baseline})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
