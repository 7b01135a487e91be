"""Request traces: arrival times and lengths, synthetic or replayed from the Azure LLM traces.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np

from nightjar.paths import TRACES_DIR

SHAPES = ("poisson:RHO", "burst", "ramp", "oscillation", "azure_conv", "azure_code")
CONTEXT_TOKENS = 1024
MAX_OUTPUT = 256


@dataclass(frozen=True)
class Trace:
    """Rates are given as multiples of the simulated machine's capacity (a function of the trace's mean
    prompt and output lengths, e.g. ``simulation.capacity_rps``), so one trace definition means the
    same load on any cost surface and length mix. Shapes: ``poisson:ρ``, ``burst``
    (phases 2→8→24→40→6 in units of capacity/20), ``ramp`` (0.1 → 1.5 → 0.1), ``oscillation``
    (sinusoid between 0.1 and 1.4), ``azure_conv`` / ``azure_code`` (the Azure 2023 traces'
    inter-arrival times, time-scaled to mean load ``azure_load``; prompt lengths scaled so the 99th
    percentile fits a ~1024-token context, outputs capped).
    """

    name: str
    arrival_ms: np.ndarray  # [n] ascending
    prompt_tokens: np.ndarray  # [n] int
    output_tokens: np.ndarray  # [n] int, >= 1

    def __post_init__(self) -> None:
        n = len(self.arrival_ms)
        assert len(self.prompt_tokens) == n == len(self.output_tokens) and n > 0
        assert np.all(np.diff(self.arrival_ms) >= 0) and self.output_tokens.min() >= 1

    @property
    def mean_prompt(self) -> float:
        return float(self.prompt_tokens.mean())

    @property
    def mean_output(self) -> float:
        return float(self.output_tokens.mean())


def synthetic_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Chat-like lengths: log-normal prompts (median 200) and outputs (median 100)."""
    prompt = np.clip(rng.lognormal(math.log(200), 0.8, n), 16, 768).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(100), 0.8, n), 8, MAX_OUTPUT).astype(np.int64)
    return prompt, output


def piecewise_poisson(rng: np.random.Generator, rates_rps: list[float], durations_s: list[float]) -> np.ndarray:
    """Arrival times (ms) of a Poisson process whose rate is constant on each piece."""
    out, start = [], 0.0
    for rate, dur in zip(rates_rps, durations_s):
        k = rng.poisson(rate * dur)
        out.append(start + np.sort(rng.random(k)) * dur)
        start += dur
    return np.concatenate(out) * 1000.0


def load_profile(shape: str) -> tuple[list[float], list[float]]:
    """Load (× capacity) per piece and the pieces' relative durations."""
    if shape.startswith("poisson:"):
        try:
            rho = float(shape.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"trace {shape!r}: expected poisson:RHO with RHO a load such as 0.5") from None
        if not rho > 0:
            raise ValueError(f"trace {shape!r}: load must be > 0")
        return [rho], [1.0]
    if shape == "burst":
        return [u / 20 for u in (2, 8, 24, 40, 6)], [1.0] * 5
    if shape == "ramp":
        up = list(np.linspace(0.1, 1.5, 15))
        return up + up[::-1], [1.0] * 30
    if shape == "oscillation":
        phase = np.linspace(0, 4 * math.pi, 40, endpoint=False)
        return list(0.75 - 0.65 * np.cos(phase)), [1.0] * 40
    raise ValueError(f"unknown trace {shape!r}; expected one of {', '.join(SHAPES)}")


CapacityFn = Callable[[float, float], float]  # (mean prompt, mean output) -> requests/s


def synthetic(shape: str, capacity: CapacityFn, requests: int = 2000, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    loads, weights = load_profile(shape)
    prompt, output = synthetic_lengths(rng, 4 * requests)
    capacity_rps = capacity(float(prompt.mean()), float(output.mean()))
    # Stretch the pieces so the expected number of requests is ``requests``.
    unit_s = requests / (capacity_rps * sum(r * w for r, w in zip(loads, weights)))
    arrivals = piecewise_poisson(rng, [r * capacity_rps for r in loads], [w * unit_s for w in weights])
    if len(arrivals) == 0:
        arrivals = np.zeros(1)
    n = min(len(arrivals), len(prompt))
    return Trace(shape, arrivals[:n], prompt[:n], output[:n])


def _read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    times, ctx, gen = [], [], []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            # Timestamps carry 7 fractional digits; datetime takes 6.
            stamp = row["TIMESTAMP"][:26]
            times.append(datetime.fromisoformat(stamp).timestamp())
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t = np.asarray(times)
    return (t - t[0]) * 1000.0, np.asarray(ctx), np.asarray(gen)


def azure(kind: str, capacity: CapacityFn, load: float = 0.8, requests: int = 2000, offset: int = 0,
          traces_dir: Path = TRACES_DIR) -> Trace:
    path = Path(traces_dir) / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.exists():
        raise ValueError(f"trace file {path} not found (set traces_dir, or use a synthetic trace)")
    t, ctx, gen = _read_azure(path)
    sl = slice(offset, offset + requests)
    t, ctx, gen = t[sl] - t[sl][0], ctx[sl], gen[sl]
    scale = 0.75 * CONTEXT_TOKENS / max(np.percentile(ctx, 99), 1.0)
    prompt = np.clip(np.round(ctx * scale), 8, CONTEXT_TOKENS - MAX_OUTPUT).astype(np.int64)
    output = np.clip(gen, 1, MAX_OUTPUT).astype(np.int64)
    # Time-scale so the mean rate is ``load`` × capacity, keeping the trace's own burstiness.
    natural_rps = (len(t) - 1) / max(t[-1] / 1000.0, 1e-9)
    t = t * natural_rps / (load * capacity(float(prompt.mean()), float(output.mean())))
    return Trace(f"azure_{kind}", t, prompt, output)


def make_trace(shape: str, capacity: CapacityFn, requests: int = 2000, seed: int = 0, azure_load: float = 0.8) -> Trace:
    if shape in ("azure_conv", "azure_code"):
        return azure(shape.split("_", 1)[1], capacity, load=azure_load, requests=requests)
    return synthetic(shape, capacity, requests=requests, seed=seed)
