"""nightjar at steady low load in the simulator: its latency stays near the best fixed γ.

The end-to-end bench's poisson:0.3 (short requests, batch ~1.6) measured nightjar at 1.13× the
mean latency of fixed:4 (1.05× and 1.22× in its two repeats). The simulator, on the measured CPU
surface with the bench's lengths, puts it at 0.99–1.02× per seed; this guards that figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner_svc.policies import make_policy
from planner_svc.simulator import SimConfig, capacity_rps, load_table, simulate
from planner_svc.simulator.trace import Trace, piecewise_poisson, synthetic_lengths

SURFACE_PATH = Path(__file__).resolve().parents[2] / "planner_svc" / "cost_surfaces" / "cpu_tiny.json"


def _bench_trace(rho: float, duration_s: float, seed: int, config: SimConfig, surface) -> Trace:
    """The end-to-end bench's lengths (the simulator's × 0.25, outputs capped at 64: mean ~65 / 30)."""
    rng = np.random.default_rng(seed)
    prompt, output = synthetic_lengths(rng, 4000)
    prompt = np.maximum(np.round(prompt * 0.25), 4).astype(np.int64)
    output = np.clip(np.round(output * 0.25), 4, 64).astype(np.int64)
    rps = rho * capacity_rps(surface, config, float(prompt.mean()), float(output.mean()))
    arrivals = piecewise_poisson(rng, [rps], [duration_s])
    n = len(arrivals)
    return Trace(f"poisson:{rho}", arrivals, prompt[:n], output[:n])


def test_steady_low_load_latency_within_5_percent_of_fixed_gamma():
    # Seeds 1–4 of this setup measured 0.989, 0.993, 0.991, 1.013× fixed:4's mean latency.
    surface = load_table(SURFACE_PATH, max_batch=256)
    surface.prefill_ms_per_token = 0.5  # the table's fallback (γ=0 slope at B=64, 2.4 ms) overprices a prompt
    config = SimConfig(gamma_max=4, max_batch=14, noise=0.1, seed=1)
    trace = _bench_trace(0.3, 120.0, seed=1, config=config, surface=surface)
    fixed = simulate(trace, make_policy("fixed:4", gamma_max=4), surface, config)
    nightjar = simulate(trace, make_policy("nightjar", gamma_max=4, seed=1), surface, config)
    assert len(trace.arrival_ms) > 300
    assert nightjar.mean_latency_ms <= 1.05 * fixed.mean_latency_ms, (nightjar.mean_latency_ms, fixed.mean_latency_ms)
    assert nightjar.throughput_tps >= 0.99 * fixed.throughput_tps
