"""How long a step takes: a parametric roofline model, or a measured table loaded from JSON.

Both expose the same precomputed arrays, ``draft_ms[B][γ]`` and ``verify_ms[B][γ]`` for every
batch size up to ``max_batch`` (a list index in the hot loop), plus prefill and catch-up costs.

Roofline (defaults calibrated to a small model on a laptop-class CPU: a batch-1 decode step
≈ 5 ms, compute-bound from ~16 tokens per pass, the draft ≈ 1/6 of the target):
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner_svc.policies.base import SurfacePrior


@dataclass(frozen=True)
class RooflineSettings:
    overhead_ms: float = 1.0  # kernel launches, sampling, Python per pass
    weights_ms: float = 4.0  # reading the weights once: the memory-bound floor
    per_token_ms: float = 0.25  # compute per token in a pass, once compute-bound
    kv_per_seq_ms: float = 0.02  # attention reads per sequence
    draft_ratio: float = 1 / 6  # draft pass cost relative to a target pass of the same shape
    prefill_ms_per_token: float = 0.1  # prompt tokens run as one large matmul: cheaper per token
    catchup_ms_fixed: float = 1.0
    catchup_ms_per_token: float = 0.1 / 6  # a draft prefill of the missed tokens

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ValueError(f"roofline {name} must be >= 0, got {value}")


class CostSurface:
    """Precomputed per-(B, γ) times; build with ``roofline()`` or ``load_table()``.

        verify(B, γ) = overhead + max(weights, per_token · B(γ+1)) + kv_per_seq · B
        draft(B, γ)  = γ · draft_ratio · (overhead + max(weights, per_token · B))

    Measured table (JSON, written by the engine benchmark)::

        {"machine": str, "batch_sizes": [..], "gammas": [0..γmax],
         "cpu": str (CPU surfaces),                        # nightjar.paths.cpu_signature: picks the default prior
         "l3_kib": int (CPU surfaces),                     # nightjar.paths.cpu_l3_kib: picks among one cpu's surfaces
         "step_ms": [[ms per γ] per batch size],          # draft + verify of one decode step
         "draft_ms": [[..]] (optional, same shape),        # else see load_table
         "acceptance_per_position": [..],                  # P(accept position i | accepted 0..i-1)
         "acceptance_kind": "conditional" (default) or "unconditional" (P(accept 0..i)),
         "catchup_ms_fixed": float, "catchup_ms_per_token": float,
         "prefill_ms_per_token": float (optional)}         # else the γ=0 slope at the largest batch

    Between measured batch sizes the table interpolates linearly; above the largest it extrapolates
    with the last slope.
    """

    def __init__(self, *, name: str, draft_ms: np.ndarray, verify_ms: np.ndarray, prefill_ms_per_token: float,
                 catchup_ms_fixed: float, catchup_ms_per_token: float,
                 acceptance: tuple[float, ...] | None = None) -> None:
        assert draft_ms.shape == verify_ms.shape and draft_ms.shape[0] >= 2  # [max_batch+1, γmax+1]
        self.name = name
        self.gamma_max = draft_ms.shape[1] - 1
        self.max_batch = draft_ms.shape[0] - 1
        self.draft_ms = draft_ms.tolist()  # lists: indexing a list is faster than numpy in the loop
        self.verify_ms = verify_ms.tolist()
        self.prefill_ms_per_token = prefill_ms_per_token
        self.catchup_ms_fixed = catchup_ms_fixed
        self.catchup_ms_per_token = catchup_ms_per_token
        self.acceptance = acceptance  # conditional per-position α_i, when the table measured it

    def step_ms(self, batch: int, gamma: int) -> float:
        return self.draft_ms[batch][gamma] + self.verify_ms[batch][gamma]

    def prior(self) -> SurfacePrior:
        """This surface at batch 1, 2, 4, … as a policy's prior (``GammaPolicy.warm_start``)."""
        sizes = tuple(1 << i for i in range(self.max_batch.bit_length()) if 1 << i <= self.max_batch)
        return SurfacePrior(sizes, tuple(tuple(self.draft_ms[b]) for b in sizes),
                            tuple(tuple(self.verify_ms[b]) for b in sizes), tuple(self.acceptance or ()))


def roofline(gamma_max: int = 4, max_batch: int = 256, settings: RooflineSettings = RooflineSettings()) -> CostSurface:
    s = settings
    b = np.arange(max_batch + 1, dtype=float)[:, None]  # [B+1, 1]
    g = np.arange(gamma_max + 1, dtype=float)[None, :]  # [1, G+1]
    verify = s.overhead_ms + np.maximum(s.weights_ms, s.per_token_ms * b * (g + 1)) + s.kv_per_seq_ms * b
    draft = g * s.draft_ratio * (s.overhead_ms + np.maximum(s.weights_ms, s.per_token_ms * b))
    return CostSurface(name="roofline", draft_ms=draft, verify_ms=verify, prefill_ms_per_token=s.prefill_ms_per_token,
                       catchup_ms_fixed=s.catchup_ms_fixed,
                       catchup_ms_per_token=s.catchup_ms_per_token)


def conditional_acceptance(unconditional: list[float]) -> tuple[float, ...]:
    """P(L > i) per position -> α_i = P(L > i | L > i-1), clamped to [0.01, 0.99]."""
    out, previous = [], 1.0
    for p in unconditional:
        p = min(max(float(p), 1e-4), previous)
        out.append(min(max(p / previous, 0.01), 0.99))
        previous = p
    return tuple(out)


def _acceptance(values: list[float], kind: str) -> tuple[float, ...]:
    if kind == "unconditional":
        return conditional_acceptance(values)
    return tuple(min(max(float(a), 0.01), 0.99) for a in values)


def _rows(batch_sizes: np.ndarray, table: np.ndarray, max_batch: int) -> np.ndarray:
    """Interpolate rows [n, G+1] at every batch 0..max_batch (linear, last-slope extrapolation)."""
    b = np.arange(max_batch + 1, dtype=float)
    out = np.stack([np.interp(b, batch_sizes, table[:, j]) for j in range(table.shape[1])], axis=1)
    if len(batch_sizes) >= 2:
        slope = np.maximum((table[-1] - table[-2]) / (batch_sizes[-1] - batch_sizes[-2]), 0.0)  # [G+1]
        above = b > batch_sizes[-1]
        out[above] = table[-1] + (b[above, None] - batch_sizes[-1]) * slope
    return out


MAX_TABLE_BYTES = 4 << 20  # a measured surface is a few kB


def load_table(path: str | Path, max_batch: int = 256, draft_ratio: float = 1 / 6,
               draft_first_factor: float = 1.0) -> CostSurface:
    """A measured table. Without ``draft_ms`` the step is split as draft = draft_ratio·step(B, 0)
    per pass, the first pass ``draft_first_factor`` times a later one (live CPU steps: 2-3×;
    BENCHMARKS.md, the live planner, seventh session). Only the split depends on these: a policy
    that models the draft apart sees it, the simulated step time is the table's."""
    if not draft_first_factor >= 1:
        raise ValueError(f"draft_first_factor must be >= 1, got {draft_first_factor}")
    try:
        if Path(path).stat().st_size > MAX_TABLE_BYTES:
            raise ValueError(f"larger than {MAX_TABLE_BYTES} bytes")
        raw = json.loads(Path(path).read_text())
        sizes = np.asarray(raw["batch_sizes"], dtype=float)
        gammas = list(raw["gammas"])
        step = np.asarray(raw["step_ms"], dtype=float)  # [n_batch, G+1]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cost surface {path}: cannot read it ({exc}); see cost_surface.py for the format") from None
    if gammas != list(range(len(gammas))) or step.shape != (len(sizes), len(gammas)) or len(sizes) < 1:
        raise ValueError(f"cost surface {path}: gammas must be 0..G and step_ms [len(batch_sizes)][len(gammas)]")
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or not np.all(step > 0):
        raise ValueError(f"cost surface {path}: batch_sizes must ascend from >= 1 and every step_ms be > 0")
    g = np.arange(len(gammas), dtype=float)[None, :]
    if "draft_ms" in raw:
        draft = np.asarray(raw["draft_ms"], dtype=float)
        if draft.shape != step.shape:
            raise ValueError(f"cost surface {path}: draft_ms must have the shape of step_ms")
    else:
        passes = draft_first_factor * np.minimum(g, 1) + np.maximum(g - 1, 0)  # [1, G+1]
        draft = np.minimum(passes * draft_ratio * step[:, :1], 0.5 * step)
    draft_all = _rows(sizes, draft, max_batch)
    step_all = _rows(sizes, step, max_batch)
    if "prefill_ms_per_token" in raw:
        prefill = float(raw["prefill_ms_per_token"])
    elif len(sizes) >= 2:
        prefill = max(float((step[-1, 0] - step[-2, 0]) / (sizes[-1] - sizes[-2])), 0.01)
    else:
        prefill = step[0, 0] / 16
    acceptance = raw.get("acceptance_per_position")
    kind = raw.get("acceptance_kind", "conditional")
    if kind not in ("conditional", "unconditional"):
        raise ValueError(f"cost surface {path}: acceptance_kind must be 'conditional' or 'unconditional'")
    return CostSurface(
        name=str(raw.get("machine", Path(path).stem)), draft_ms=draft_all, verify_ms=step_all - draft_all,
        prefill_ms_per_token=prefill,
        catchup_ms_fixed=float(raw.get("catchup_ms_fixed", 1.0)),
        catchup_ms_per_token=float(raw.get("catchup_ms_per_token", prefill * draft_ratio)),
        acceptance=_acceptance(acceptance, kind) if acceptance else None)
