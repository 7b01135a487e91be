"""A fitted step-time model t(B, γ) = γ·d(B) + v(B·(γ+1)) + r(B), learned online from StepStats.

The verify pass costs v(n) for n = B·(γ+1) tokens (roofline: flat while memory-bound, linear
once compute-bound), and the draft costs d(B) per pass, γ passes a step. Both are learned as
running means per n (per B for the draft) with a capped weight, i.e. a mean that turns into an
exponential average of the last ``cap`` observations, so old data decays as new data arrives.
Between observed points the model interpolates linearly; beyond the observed range on either
side it extrapolates with the slope of the nearest half of the range, clamped to [0, v/n] (flat
= memory-bound, proportional = compute-bound: the two roofline limits). Below the range that
errs optimistic, so an unplayed cheap arm gets probed rather than written off. Outside
the batch sizes the draft was measured at, d(B) follows the shape of v: d(B₀)·v(B)/v(B₀).

So a γ=0 step at B=32 (n = 32) predicts the verify cost of γ=3 at B=8 (n = 32): one
observation teaches every arm with the same token count. No offline profiling.

r(B) is the part of a verify pass that grows with the number of sequences rather than tokens:
attention reads each sequence's whole KV, and on a CPU engine the per-sequence bookkeeping
shows too (two runs of scripts/bench_speculation.py on the shipped pair: B=32 at γ=0 took
52–73 ms, B=16 at γ=1 — the same 32 tokens — 33–35 ms). Without it, v(32) averages the two and the model calls γ>0 dear at large
batches where it is cheap. v and r are fitted together by backfitting one observation at a
time: v(n) learns the step minus r(B), r(B) the step minus v(n). Between and beyond the batch
sizes seen, r interpolates and stays flat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepCostSettings:
    max_tokens: int = 2048  # largest n = B·(γ+1) tracked; beyond it, the last cell
    weight_cap: float = 64.0  # running mean becomes an EMA over ~this many observations per cell
    draft_prior_ratio: float = 0.25  # d(B) ≈ this · v(B) until a draft pass has been observed

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if not self.weight_cap >= 1:
            raise ValueError(f"weight_cap must be >= 1, got {self.weight_cap}")
        if not self.draft_prior_ratio > 0:
            raise ValueError(f"draft_prior_ratio must be > 0, got {self.draft_prior_ratio}")


class _Curve:
    """Running means at integer x with capped weight, and the roofline interpolation."""

    def __init__(self, size: int, cap: float) -> None:
        self.mean = np.zeros(size + 1)
        self.weight = np.zeros(size + 1)
        self.cap = cap
        self._xp: np.ndarray | None = None
        # predict()'s knots and end slopes, until the next observation: one decision predicts
        # several curves at several shapes between two steps.
        self._fit: tuple | None = None

    def observe(self, x: int, value: float) -> None:
        # Called on every step: .item() reads a Python float, cheaper than a numpy scalar, and
        # float arithmetic gives the same doubles.
        x = min(max(x, 1), len(self.mean) - 1)
        seen = self.weight.item(x)
        w = min(seen + 1.0, self.cap)
        if seen == 0:
            self._xp = None
        self._fit = None
        self.weight[x] = w
        mean = self.mean.item(x)
        self.mean[x] = mean + (value - mean) / w

    @property
    def empty(self) -> bool:
        return not self.weight.any()

    def bounds(self) -> tuple[int, int]:
        xs = np.flatnonzero(self.weight)
        return int(xs[0]), int(xs[-1])

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self._fit is None:
            self._fit = self._knots()
        xp, fp, top_x, top_v, top_slope, low_x, low_v, low_slope = self._fit
        out = np.interp(x, xp, fp)
        out = np.where(x > top_x, top_v + top_slope * (x - top_x), out)
        return np.where(x < low_x, low_v - low_slope * (low_x - x), out)

    def _knots(self) -> tuple:
        if self._xp is None:
            self._xp = np.flatnonzero(self.weight)
        xp = self._xp
        if len(xp) == 0:
            raise ValueError("no observations yet")
        fp = self.mean[xp]
        top_x, top_v, low_x, low_v = xp[-1], fp[-1], xp[0], fp[0]
        if len(xp) >= 2:
            # Slopes over the upper / lower half of the observed range, so one noisy cell does
            # not set them.
            lo = xp[np.searchsorted(xp, top_x // 2, side="left")]
            lo = lo if lo < top_x else xp[-2]
            top_slope = (top_v - self.mean[lo]) / (top_x - lo)
            hi = xp[np.searchsorted(xp, 2 * low_x, side="right") - 1]
            hi = hi if hi > low_x else xp[1]
            low_slope = (self.mean[hi] - low_v) / (hi - low_x)
        else:
            top_slope = low_slope = 0.5 * top_v / top_x  # one point: halfway between the limits
        # Clamp to the roofline's limits: flat (memory-bound) ... proportional (compute-bound).
        top_slope = min(max(top_slope, 0.0), top_v / top_x)
        low_slope = min(max(low_slope, 0.0), low_v / low_x)
        return xp, fp, top_x, top_v, top_slope, low_x, low_v, low_slope

    def state_dict(self) -> dict[str, Any]:
        idx = np.flatnonzero(self.weight)
        return {"x": idx.tolist(), "mean": self.mean[idx].tolist(), "weight": self.weight[idx].tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        xs = [int(x) for x in state.get("x", ())]
        if xs and max(xs) < len(self.mean):
            self.mean[:] = 0
            self.weight[:] = 0
            self.mean[xs] = state["mean"]
            self.weight[xs] = state["weight"]
            self._xp = None
            self._fit = None


class _PerBatch(_Curve):
    """r(B): running means per batch size, any sign; linear between the sizes seen, flat beyond."""

    def value(self, x: int) -> float:
        """r at one batch size; the cell itself once seen (the cheap path, every step)."""
        x = min(max(x, 1), len(self.mean) - 1)
        if self.weight.item(x) > 0:
            return self.mean.item(x)
        return 0.0 if self.empty else float(self.predict(np.array([float(x)]))[0])

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.empty:
            return np.zeros_like(np.asarray(x, dtype=float))
        if self._fit is None:
            if self._xp is None:
                self._xp = np.flatnonzero(self.weight)
            self._fit = (self._xp, self.mean[self._xp])
        xp, fp = self._fit
        return np.interp(x, xp, fp)


class StepCostModel:
    def __init__(self, settings: StepCostSettings = StepCostSettings()) -> None:
        self.settings = settings
        self.verify = _Curve(settings.max_tokens, settings.weight_cap)
        self.per_seq = _PerBatch(settings.max_tokens, settings.weight_cap)  # r(B)
        self.draft = _Curve(settings.max_tokens, settings.weight_cap)
        # catch-up (switching) cost per event, as decayed sums
        self.catchup_ms_sum = 0.0
        self.catchup_tokens_sum = 0.0
        self.catchup_events = 0.0
        self.prefill_ms_per_token = 0.0  # target prefill rows riding in a decode step, learned
        self.prefill_seen = 0.0

    def observe(self, batch_size: int, gamma: int, draft_ms: float, verify_ms: float) -> None:
        self._observe_verify(batch_size, batch_size * (gamma + 1), verify_ms)
        if gamma > 0:
            self.draft.observe(batch_size, draft_ms / gamma)

    def _observe_verify(self, batch_size: int, n: int, verify_ms: float) -> None:
        cell = min(n, len(self.verify.weight) - 1)
        if self.verify.weight.item(cell) > 0:  # r learns what v(n) leaves unexplained ...
            self.per_seq.observe(batch_size, verify_ms - self.verify.mean.item(cell))
        self.verify.observe(n, verify_ms - self.per_seq.value(batch_size))  # ... and v what r does

    def observe_mixed(self, batch_size: int, gamma: int, draft_ms: float, verify_ms: float, prefill_tokens: int) -> None:
        """A step whose target forward also prefilled new prompts (the engine mixes them).

        verify_ms ≈ v(n) + c·prefill_tokens. Where v(n) is already known, the residual teaches c
        (a running mean); once c is known, the step also teaches v(n) with c·prefill removed.
        """
        n = batch_size * (gamma + 1)
        if gamma > 0:
            self.draft.observe(batch_size, draft_ms / gamma)
        cell = min(n, len(self.verify.weight) - 1)
        if self.verify.weight[cell] >= 4:
            decode_ms = self.verify.mean.item(cell) + self.per_seq.value(batch_size)
            per_token = max((verify_ms - decode_ms) / prefill_tokens, 0.0)
            self.prefill_seen = min(self.prefill_seen + 1.0, self.settings.weight_cap)
            self.prefill_ms_per_token += (per_token - self.prefill_ms_per_token) / self.prefill_seen
        if self.prefill_seen >= 8:
            self._observe_verify(batch_size, n, max(verify_ms - self.prefill_ms_per_token * prefill_tokens, 0.0))

    def observe_catchup(self, tokens: int, ms: float) -> None:
        decay = 0.95  # switching costs drift with context length; keep ~20 events
        self.catchup_ms_sum = self.catchup_ms_sum * decay + ms
        self.catchup_tokens_sum = self.catchup_tokens_sum * decay + tokens
        self.catchup_events = self.catchup_events * decay + 1

    @property
    def ready(self) -> bool:
        return not self.verify.empty

    def step_ms(self, batch_sizes: np.ndarray, gamma_max: int) -> np.ndarray:
        """Predicted draft + verify ms, shape [len(batch_sizes), gamma_max + 1]."""
        b = np.asarray(batch_sizes, dtype=float)[:, None]  # [k, 1]
        g = np.arange(gamma_max + 1, dtype=float)[None, :]  # [1, G+1]
        verify = self.verify.predict(b * (g + 1)) + self.per_seq.predict(b)  # [k, G+1]
        target = verify[:, :1]  # [k, 1] the target's pass at B tokens: the γ=0 column
        if self.draft.empty:
            per_pass = self.settings.draft_prior_ratio * target  # [k, 1]
        else:
            # Outside the batch sizes the draft was seen at, scale its nearest measurement by the
            # target's curve: both are the same roofline shape, only the constant differs.
            lo, hi = self.draft.bounds()
            inside = np.clip(b, lo, hi)
            at_inside = self.verify.predict(inside) + self.per_seq.predict(inside)  # [k, 1]
            per_pass = self.draft.predict(inside) * target / np.maximum(at_inside, 1e-9)
        return verify + g * per_pass

    def catchup_ms_per_event(self) -> float:
        return self.catchup_ms_sum / self.catchup_events if self.catchup_events else 0.0

    def catchup_ms_per_token(self) -> float:
        return self.catchup_ms_sum / self.catchup_tokens_sum if self.catchup_tokens_sum else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"verify": self.verify.state_dict(), "draft": self.draft.state_dict(),
                "per_seq": self.per_seq.state_dict(),
                "catchup": [self.catchup_ms_sum, self.catchup_tokens_sum, self.catchup_events],
                "prefill": [self.prefill_ms_per_token, self.prefill_seen]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.verify.load_state_dict(state.get("verify", {}))
        self.draft.load_state_dict(state.get("draft", {}))
        self.per_seq.load_state_dict(state.get("per_seq", {}))
        c = state.get("catchup", [0.0, 0.0, 0.0])
        self.catchup_ms_sum, self.catchup_tokens_sum, self.catchup_events = (float(x) for x in c)
        self.prefill_ms_per_token, self.prefill_seen = (float(x) for x in state.get("prefill", [0.0, 0.0]))
