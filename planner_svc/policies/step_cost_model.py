"""A fitted step-time model t(B, γ) = d₁(B) + (γ-1)·d₊(B) + v(B·(γ+1)) + r(B) (γ ≥ 1; γ = 0 has no
draft term), learned online from StepStats.
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepCostSettings:
    max_tokens: int = 2048  # largest n = B·(γ+1) tracked; beyond it, the last cell
    weight_cap: float = 64.0  # running mean becomes an EMA over ~this many observations per cell
    draft_prior_ratio: float = 0.25  # a draft pass ≈ this · v(B) until one has been observed
    # A cell's weight halves for every this many steps (of any cell) in which it was not observed:
    # an arm measured once, in a load transition or a slow minute of a shared machine, is then
    # re-priced by its next probe instead of being nudged by 1/weight_cap per step.
    half_life_steps: float = 256.0
    # A step that also prefilled prompts teaches v(n) only while its prefill rows (c·P) cost at
    # most this many times its decode rows: past that, c's error swamps v(n). Live under a queue
    # of long prompts (P ≈ 430 beside n ≈ 21-84), c learned at 0.49 against 0.6-0.65 there pushed
    # 50 ms a step into v(21), and γ = 0 looked 3× its cost (BENCHMARKS.md, the live planner).
    # A closed loop's turnover steps (one short prompt beside a small batch) stay below it.
    max_prefill_ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if not self.weight_cap >= 1:
            raise ValueError(f"weight_cap must be >= 1, got {self.weight_cap}")
        if not self.half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        if not self.draft_prior_ratio > 0:
            raise ValueError(f"draft_prior_ratio must be > 0, got {self.draft_prior_ratio}")
        if not self.max_prefill_ratio > 0:
            raise ValueError(f"max_prefill_ratio must be > 0, got {self.max_prefill_ratio}")


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            s, w2, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += n
    out: list[float] = []
    for s, w, n in blocks:
        out += [s / w] * int(n)
    return out


class _Curve:
    """Running means at integer x with capped weight, and the roofline interpolation.

    ``observe`` runs on every step, so the cells are Python lists (a list read or write is a
    fraction of a numpy scalar one, and float arithmetic gives the same doubles) and the
    observed x are kept sorted as they appear (``xs``), instead of being found again with
    ``flatnonzero`` on every fit. ``predict`` builds numpy knots from them once per change.
    """

    def __init__(self, size: int, cap: float, half_life: float = math.inf) -> None:
        self.mean = [0.0] * (size + 1)
        self.weight = [0.0] * (size + 1)
        self.last = [0] * (size + 1)  # the step clock at the cell's last observation
        self.top = size  # largest x; larger ones land in this cell
        self.cap = cap
        self.decay = 0.5 ** (1.0 / half_life)  # weight kept per step without an observation
        self.xs: list[int] = []  # x with weight != 0, ascending: the knots
        # predict()'s knots and end slopes, until the next observation: one decision predicts
        # several curves at several shapes between two steps.
        self._fit: tuple | None = None

    def observe(self, x: int, value: float, now: int = 0) -> None:
        """One observation at step ``now`` of the caller's clock."""
        x = 1 if x < 1 else self.top if x > self.top else x
        seen = self.weight[x]
        if seen == 0:
            bisect.insort(self.xs, x)
        elif now - self.last[x] > 1:
            seen *= self.decay ** (now - self.last[x] - 1)
        self.last[x] = now
        w = seen + 1.0
        if w > self.cap:
            w = self.cap
        self._fit = None
        self.weight[x] = w
        mean = self.mean[x]
        self.mean[x] = mean + (value - mean) / w

    @property
    def empty(self) -> bool:
        return not self.xs

    def bounds(self) -> tuple[int, int]:
        return self.xs[0], self.xs[-1]

    def predict(self, x: np.ndarray, x_min: float | None = None, x_max: float | None = None,
                optimistic: bool = False) -> np.ndarray:
        """v at every x; ``x_min`` / ``x_max``: x's extremes, where the caller knows them.
        ``optimistic``: below the knots, the lowest the roofline allows (v proportional to x)."""
        if self._fit is None:
            self._fit = self._knots()
        xp, fp, top_x, top_v, top_slope, low_x, low_v, low_slope = self._fit
        if optimistic:
            low_slope = low_v / low_x
        out = np.interp(x, xp, fp)
        # Each numpy call on these few-element arrays costs about what the arithmetic does, so
        # the extrapolations are computed only where some x lies beyond the knots.
        if (x.max() if x_max is None else x_max) > top_x:
            out = np.where(x > top_x, top_v + top_slope * (x - top_x), out)
        if (x.min() if x_min is None else x_min) < low_x:
            out = np.where(x < low_x, low_v - low_slope * (low_x - x), out)
        return out

    def _points(self) -> tuple[np.ndarray, np.ndarray]:
        """The knots as arrays: x [k] (int) and their means [k]."""
        xs = self.xs
        means = operator.itemgetter(*xs)(self.mean) if len(xs) > 1 else [self.mean[x] for x in xs]
        return np.array(xs, dtype=np.intp), np.array(means, dtype=float)

    def _knots(self) -> tuple:
        xs = self.xs
        if not xs:
            raise ValueError("no observations yet")
        # Verifying more tokens (drafting for more sequences) never costs less, but cells are
        # learned apart and the stack's steps are noisy (prefill rows, other processes): on a
        # real stack the raw cells made a γ=3 step at B=8 cheaper than a γ=0 one, and the
        # argmin chased that noise. Fit the knots as a non-decreasing curve (weighted isotonic
        # regression), which keeps every cell's information and only pools the ones that cross.
        values = _isotonic([self.mean[x] for x in xs], [self.weight[x] for x in xs])
        xp, fp = np.array(xs, dtype=np.intp), np.array(values)
        top_x, low_x = xs[-1], xs[0]
        top_v, low_v = values[-1], values[0]
        if len(xs) >= 2:
            # Slopes over the upper / lower half of the observed range, so one noisy cell does
            # not set them.
            i = bisect.bisect_left(xs, top_x // 2)
            i = i if xs[i] < top_x else len(xs) - 2
            top_slope = (top_v - values[i]) / (top_x - xs[i])
            j = bisect.bisect_right(xs, 2 * low_x) - 1
            j = j if xs[j] > low_x else 1
            low_slope = (values[j] - low_v) / (xs[j] - low_x)
        else:
            top_slope = low_slope = 0.5 * top_v / top_x  # one point: halfway between the limits
        # Clamp to the roofline's limits: flat (memory-bound) ... proportional (compute-bound).
        top_slope = min(max(top_slope, 0.0), top_v / top_x)
        low_slope = min(max(low_slope, 0.0), low_v / low_x)
        return xp, fp, top_x, top_v, top_slope, low_x, low_v, low_slope

    def state_dict(self) -> dict[str, Any]:
        return {"x": list(self.xs), "mean": [self.mean[x] for x in self.xs],
                "weight": [self.weight[x] for x in self.xs], "last": [self.last[x] for x in self.xs]}

    def load_state_dict(self, state: dict[str, Any], now: int = 0) -> None:
        xs = [int(x) for x in state.get("x", ())]
        if xs and min(xs) >= 0 and max(xs) < len(self.mean):
            self.mean = [0.0] * len(self.mean)
            self.weight = [0.0] * len(self.weight)
            self.last = [0] * len(self.last)
            for x, m, w, t in zip(xs, state["mean"], state["weight"], state.get("last", [now] * len(xs))):
                self.mean[x], self.weight[x], self.last[x] = float(m), float(w), int(t)
            self.xs = [x for x, w in enumerate(self.weight) if w != 0]
            self._fit = None


class _PerBatch(_Curve):
    """r(B): running means per batch size, linear between the sizes seen, flat beyond.

    The means take residuals of either sign and the value is bounded at 0 where it is read, not
    where it is learned: bounding each residual at 0 biased the mean up by the noise's positive
    half, v(n) then learned the step minus that, the next residuals came out larger, and where
    one γ is played at a batch (so nothing else pins the split) r(B) ratcheted up step by step
    (BENCHMARKS.md, the live planner, fifth session)."""

    def value(self, x: int) -> float:
        """r at one batch size; the cell itself once seen (the cheap path, every step)."""
        x = 1 if x < 1 else self.top if x > self.top else x
        if self.weight[x] > 0:
            mean = self.mean[x]
            return mean if mean > 0.0 else 0.0
        return 0.0 if not self.xs else float(self.predict(np.array([float(x)]))[0])

    def predict(self, x: np.ndarray, x_min: float | None = None, x_max: float | None = None,
                optimistic: bool = False) -> np.ndarray:
        if not self.xs:  # (no extrapolation here, so x's extremes are not needed)
            return np.zeros_like(np.asarray(x, dtype=float))
        if self._fit is None:
            xp, fp = self._points()
            self._fit = xp, np.maximum(fp, 0.0)
        xp, fp = self._fit
        return np.interp(x, xp, fp)


class StepCostModel:
    """The verify pass costs v(n) for n = B·(γ+1) tokens (roofline: flat while memory-bound, linear
    once compute-bound), and the draft's γ passes cost d₁(B) for the first and d₊(B) for each
    further one. All are learned as running means per n (per B for the draft) with a capped
    weight, i.e. a mean that turns into an exponential average of the last ``cap`` observations,
    so old data decays as new data arrives, and whose weight also halves every ``half_life_steps``
    steps the cell goes unobserved, so the next observations of a cell last seen long ago count
    for nearly all of it. The curves are fitted non-decreasing (isotonic), since
    more tokens never cost less.
    Between observed points the model interpolates linearly; beyond the observed range on either
    side it extrapolates with the slope of the nearest half of the range, clamped to [0, v/n] (flat
    = memory-bound, proportional = compute-bound: the two roofline limits). Below the range that
    errs optimistic, so an unplayed cheap arm gets probed rather than written off. Outside
    the batch sizes the draft was measured at, d(B) follows the shape of v: d(B₀)·v(B)/v(B₀).

    The first draft pass costs more than each later one (it feeds up to two tokens, and on a CPU
    it follows the target's pass, which has pushed the draft's weights out of cache), so the
    draft's step is affine in γ, not proportional. One per-pass d(B) learned from γ = 1 priced a
    deeper γ far too dear and held the policy at γ = 1 (BENCHMARKS.md, the live planner, seventh
    session). So d₁(B) learns from γ = 1 steps and d₊(B) from deeper ones, net of d₁(B); before
    a deeper pass is seen, d₊ = d₁ (pessimistic for deep γ), and before a γ = 1 step, d₁ = d₊.

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

    def __init__(self, settings: StepCostSettings = StepCostSettings()) -> None:
        self.settings = settings
        curve = (settings.max_tokens, settings.weight_cap, settings.half_life_steps)
        self.verify = _Curve(*curve)
        self.per_seq = _PerBatch(*curve)  # r(B)
        self.draft_first = _Curve(*curve)  # d₁(B)
        self.draft_next = _Curve(*curve)  # d₊(B)
        self.clock = 0  # steps observed: a cell's weight decays with the steps since it was seen
        # catch-up (switching) cost per event, as decayed sums
        self.catchup_ms_sum = 0.0
        self.catchup_tokens_sum = 0.0
        self.catchup_events = 0.0
        self.prefill_ms_per_token = 0.0  # target prefill rows riding in a decode step, learned
        self.prefill_seen = 0.0
        self._arms_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def observe(self, batch_size: int, gamma: int, draft_ms: float, verify_ms: float) -> None:
        self.clock += 1
        self._observe_verify(batch_size, batch_size * (gamma + 1), verify_ms)
        self._observe_draft(batch_size, gamma, draft_ms)

    def _observe_draft(self, batch_size: int, gamma: int, draft_ms: float) -> None:
        if gamma == 1:
            self.draft_first.observe(batch_size, draft_ms, self.clock)
        elif gamma > 1:
            first = self.draft_first
            if first.empty:  # no first pass seen yet: split evenly
                self.draft_next.observe(batch_size, draft_ms / gamma, self.clock)
                return
            cell = batch_size if batch_size < first.top else first.top
            if first.weight[cell] > 0:
                d1 = first.mean[cell]
            elif self.verify.empty:  # (only mixed steps so far)
                d1 = float(first.predict(np.array([float(batch_size)]))[0])
            else:  # as step_ms predicts it
                b = np.array([[float(batch_size)]])  # [1, 1]
                target = self.verify.predict(b) + self.per_seq.predict(b)
                d1 = float(self._draft_pass(first, b, float(batch_size), float(batch_size), target)[0, 0])
            rest = draft_ms - d1
            self.draft_next.observe(batch_size, (rest if rest > 0.0 else 0.0) / (gamma - 1), self.clock)

    def _observe_verify(self, batch_size: int, n: int, verify_ms: float) -> None:
        verify, per_seq = self.verify, self.per_seq
        cell = n if n < verify.top else verify.top
        # Both parts are times, so neither is read below 0. Without that bound the split between
        # them is free wherever one γ is played at a few batch sizes (n and B move together), and
        # a live stack's noisy, prefill-laden steps walked it apart into negative predicted step
        # times (BENCHMARKS.md, the live planner). r's bound applies where it is read (_PerBatch).
        if verify.weight[cell] > 0:  # r learns what v(n) leaves unexplained ...
            per_seq.observe(batch_size, verify_ms - verify.mean[cell], self.clock)
        rest = verify_ms - per_seq.value(batch_size)
        verify.observe(n, rest if rest > 0.0 else 0.0, self.clock)  # ... and v what r does

    def observe_mixed(self, batch_size: int, gamma: int, draft_ms: float, verify_ms: float, prefill_tokens: int) -> bool:
        """A step whose target forward also prefilled new prompts (the engine mixes them).

        verify_ms ≈ v(n) + c·prefill_tokens. Where v(n) is already known (``_decode_ms``), the
        residual teaches c (a running mean); once c is known, the step also teaches v(n) with
        c·prefill removed, unless the prefill dominates the step (``_dominates``).
        -> False where it dominates: the step measured c's error more than its decode rows.
        """
        n = batch_size * (gamma + 1)
        self.clock += 1
        self._observe_draft(batch_size, gamma, draft_ms)
        decode_ms = self._decode_ms(batch_size, n)
        if decode_ms is not None:
            per_token = max((verify_ms - decode_ms) / prefill_tokens, 0.0)
            self.prefill_seen = min(self.prefill_seen + 1.0, self.settings.weight_cap)
            self.prefill_ms_per_token += (per_token - self.prefill_ms_per_token) / self.prefill_seen
        if decode_ms is not None and self._dominates(prefill_tokens, decode_ms):
            return False
        if self.prefill_seen >= 8:
            self._observe_verify(batch_size, n, max(verify_ms - self.prefill_ms_per_token * prefill_tokens, 0.0))
        return True

    def _dominates(self, prefill_tokens: int, decode_ms: float) -> bool:
        """Whether a step's prefill rows cost more than ``max_prefill_ratio`` times its decode
        rows (then it says little about the decode rows: c's error is larger than they are)."""
        return self.prefill_ms_per_token * prefill_tokens > self.settings.max_prefill_ratio * decode_ms

    def seed(self, batch_sizes: list[int], draft_ms: list[list[float]], verify_ms: list[list[float]],
             weight: float = 4.0) -> None:
        """Start from an offline surface: draft_ms, verify_ms [len(batch_sizes)][γ+1] per step.
        Each cell is observed ``weight`` times, round robin, through the same backfitting as a
        live step (so v(n) and r(B) separate as they do online); live steps, whose weight is
        capped at ``weight_cap``, then take over."""
        for _ in range(int(weight)):
            for b, drafts, verifies in zip(batch_sizes, draft_ms, verify_ms):
                for g, (d, v) in enumerate(zip(drafts, verifies)):
                    self.observe(b, g, d, v)

    def _decode_ms(self, batch_size: int, n: int) -> float | None:
        """v(n) + r(B) where the curve knows n: a well-measured cell, or between two measured ones.

        A mixed step rarely lands on a pure-decode cell: in a closed loop a new prompt joins
        when a sequence leaves, so decode steps run at B and mixed ones at B - 1 (another n).
        Requiring the exact cell left c unlearned there, every mixed step looked dearer than
        predicted, and the policy's change detector restarted its schedule on nearly every bin."""
        verify = self.verify
        cell = n if n < verify.top else verify.top
        if verify.weight[cell] >= 4:
            return verify.mean[cell] + self.per_seq.value(batch_size)
        xs = verify.xs
        if len(xs) >= 2 and xs[0] < n < xs[-1]:
            return float(verify.predict(np.array([float(n)]))[0]) + self.per_seq.value(batch_size)
        return None

    def observe_catchup(self, tokens: int, ms: float) -> None:
        decay = 0.95  # switching costs drift with context length; keep ~20 events
        self.catchup_ms_sum = self.catchup_ms_sum * decay + ms
        self.catchup_tokens_sum = self.catchup_tokens_sum * decay + tokens
        self.catchup_events = self.catchup_events * decay + 1

    @property
    def ready(self) -> bool:
        return not self.verify.empty

    def step_ms(self, batch_sizes: np.ndarray, gamma_max: int, optimistic: bool = False) -> np.ndarray:
        """Predicted draft + verify ms, shape [len(batch_sizes), gamma_max + 1].

        ``optimistic``: v(n) below the token counts seen is extrapolated at the roofline's
        lowest (proportional to n), not at the fitted slope. At a high batch only γ > 0 may have
        been played, and γ = 0's n = B lies far below every knot; the fitted slope of a narrow
        range is noise, and once it overpriced γ = 0 at batch 64 so far that no probe ever tried
        it (BENCHMARKS.md, the live planner). Probes value arms optimistically."""
        b = np.asarray(batch_sizes, dtype=float)[:, None]  # [k, 1]
        g1, first_pass, next_passes = self._arms(gamma_max)  # [1, G+1] each: γ+1, min(γ, 1), max(γ-1, 0)
        b_min, b_max = float(b.min()), float(b.max())
        # b·(γ+1) spans b_min·1 .. b_max·(γmax+1), the same products the array holds
        n_max = b_max * float(gamma_max + 1)
        verify = self.verify.predict(b * g1, b_min, n_max, optimistic) + self.per_seq.predict(b)  # [k, G+1]
        target = verify[:, :1]  # [k, 1] the target's pass at B tokens: the γ=0 column
        first = self._draft_pass(self.draft_first, b, b_min, b_max, target)  # [k, 1] or None
        later = self._draft_pass(self.draft_next, b, b_min, b_max, target)
        if first is None and later is None:  # no draft pass seen yet
            first = later = self.settings.draft_prior_ratio * target
        first = later if first is None else first
        later = first if later is None else later
        return verify + first_pass * first + next_passes * later

    def _draft_pass(self, curve: _Curve, b: np.ndarray, b_min: float, b_max: float,
                    target: np.ndarray) -> np.ndarray | None:
        """One draft curve at batch sizes b [k, 1], or None before it has a point. Outside the
        batch sizes it was seen at, its nearest measurement is scaled by the target's curve: both
        are the same roofline shape, only the constant differs."""
        if curve.empty:
            return None
        lo, hi = curve.bounds()
        if lo <= b_min and b_max <= hi:  # all inside: the target there is the γ=0 column
            return curve.predict(b, b_min, b_max)
        inside = np.clip(b, lo, hi)
        in_min, in_max = min(max(b_min, lo), hi), min(max(b_max, lo), hi)
        at_inside = self.verify.predict(inside, in_min, in_max) + self.per_seq.predict(inside)  # [k, 1]
        return curve.predict(inside, in_min, in_max) * target / np.maximum(at_inside, 1e-9)

    def _arms(self, gamma_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """γ+1, min(γ, 1) and max(γ-1, 0) as [1, γmax+1] rows, built once (read-only: shared by
        every prediction)."""
        arms = self._arms_cache.get(gamma_max)
        if arms is None:
            g = np.arange(gamma_max + 1, dtype=float)[None, :]
            arms = (g + 1, np.minimum(g, 1.0), np.maximum(g - 1, 0.0))
            for a in arms:
                a.flags.writeable = False
            self._arms_cache[gamma_max] = arms
        return arms

    def catchup_ms_per_event(self) -> float:
        return self.catchup_ms_sum / self.catchup_events if self.catchup_events else 0.0

    def catchup_ms_per_token(self) -> float:
        return self.catchup_ms_sum / self.catchup_tokens_sum if self.catchup_tokens_sum else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"verify": self.verify.state_dict(), "draft_first": self.draft_first.state_dict(),
                "draft_next": self.draft_next.state_dict(),
                "per_seq": self.per_seq.state_dict(),
                "catchup": [self.catchup_ms_sum, self.catchup_tokens_sum, self.catchup_events],
                "prefill": [self.prefill_ms_per_token, self.prefill_seen], "clock": self.clock}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))  # (an older state's cells count as seen now)
        self.verify.load_state_dict(state.get("verify", {}), self.clock)
        self.draft_first.load_state_dict(state.get("draft_first", {}), self.clock)  # (an older state's per-pass "draft" is relearned)
        self.draft_next.load_state_dict(state.get("draft_next", {}), self.clock)
        self.per_seq.load_state_dict(state.get("per_seq", {}), self.clock)
        c = state.get("catchup", [0.0, 0.0, 0.0])
        self.catchup_ms_sum, self.catchup_tokens_sum, self.catchup_events = (float(x) for x in c)
        self.prefill_ms_per_token, self.prefill_seen = (float(x) for x in state.get("prefill", [0.0, 0.0]))
