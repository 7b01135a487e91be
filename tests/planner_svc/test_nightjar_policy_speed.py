"""The nightjar policy's cheap per-step bookkeeping equals the from-scratch computation it replaces.

update() keeps its statistics in Python lists, keeps the cost curves' knots sorted as cells appear,
caches a bucket's support until its histogram changes and skips extrapolations no x needs. Each
of those must give the very doubles of the plain numpy formulas (written out here as
references), or the policy's decisions would drift from what was benchmarked.
"""

from __future__ import annotations

import random

import numpy as np

from planner_svc.policies.base import bucket_index
from planner_svc.policies.nightjar import NightjarPolicy, _Timeline
from planner_svc.policies.step_cost_model import StepCostModel, _Curve, _isotonic


def _reference_curve_predict(curve: _Curve, x: np.ndarray) -> np.ndarray:
    """_Curve.predict from scratch: knots from the weights, both extrapolations always applied."""
    weight, mean = np.array(curve.weight), np.array(curve.mean)
    xp = np.flatnonzero(weight)
    fitted = np.zeros_like(mean)
    fitted[xp] = _isotonic(mean[xp].tolist(), weight[xp].tolist())  # checked on its own below
    fp = fitted[xp]
    top_x, top_v, low_x, low_v = xp[-1], fp[-1], xp[0], fp[0]
    if len(xp) >= 2:
        lo = xp[np.searchsorted(xp, top_x // 2, side="left")]
        lo = lo if lo < top_x else xp[-2]
        top_slope = (top_v - fitted[lo]) / (top_x - lo)
        hi = xp[np.searchsorted(xp, 2 * low_x, side="right") - 1]
        hi = hi if hi > low_x else xp[1]
        low_slope = (fitted[hi] - low_v) / (hi - low_x)
    else:
        top_slope = low_slope = 0.5 * top_v / top_x
    top_slope = min(max(top_slope, 0.0), top_v / top_x)
    low_slope = min(max(low_slope, 0.0), low_v / low_x)
    out = np.interp(x, xp, fp)
    out = np.where(x > top_x, top_v + top_slope * (x - top_x), out)
    return np.where(x < low_x, low_v - low_slope * (low_x - x), out)


def _reference_per_batch(model: StepCostModel, x: np.ndarray) -> np.ndarray:
    weight = np.array(model.per_seq.weight)
    xp = np.flatnonzero(weight)
    if len(xp) == 0:
        return np.zeros_like(x)
    return np.interp(x, xp, np.maximum(np.array(model.per_seq.mean)[xp], 0.0))


def _reference_step_ms(model: StepCostModel, sizes: np.ndarray, gamma_max: int) -> np.ndarray:
    """StepCostModel.step_ms from scratch: the draft's range always clipped and re-predicted."""
    b = np.asarray(sizes, dtype=float)[:, None]
    g = np.arange(gamma_max + 1, dtype=float)[None, :]
    verify = _reference_curve_predict(model.verify, b * (g + 1)) + _reference_per_batch(model, b)
    target = verify[:, :1]
    def per_pass(curve):
        seen = np.flatnonzero(np.array(curve.weight))
        if len(seen) == 0:
            return None
        inside = np.clip(b, seen[0], seen[-1])
        at_inside = _reference_curve_predict(model.verify, inside) + _reference_per_batch(model, inside)
        return _reference_curve_predict(curve, inside) * target / np.maximum(at_inside, 1e-9)

    first, later = per_pass(model.draft_first), per_pass(model.draft_next)
    if first is None and later is None:
        first = later = model.settings.draft_prior_ratio * target
    first = later if first is None else first
    later = first if later is None else later
    return verify + np.minimum(g, 1) * first + np.maximum(g - 1, 0) * later


def _observe_noisy_roofline(model: StepCostModel, rng: random.Random, steps: int, batches: range) -> None:
    for _ in range(steps):
        b, g = rng.choice(batches), rng.randrange(5)
        verify = (1.0 + max(4.0, 0.25 * b * (g + 1)) + 0.02 * b) * rng.uniform(0.8, 1.2)
        if rng.random() < 0.1:
            model.observe_mixed(b, g, 0.3 * g, verify + 0.05 * 100, prefill_tokens=100)
        else:
            model.observe(b, g, 0.3 * g * rng.uniform(0.8, 1.2), verify)


def test_isotonic_fit_is_the_weighted_max_min_of_averages():
    rng = random.Random(3)
    for n in (1, 2, 5, 17):
        ys = [rng.uniform(0, 10) for _ in range(n)]
        ws = [rng.choice([1.0, 4.0, 64.0]) for _ in range(n)]
        got = _isotonic(ys, ws)

        def avg(j, k):
            return sum(y * w for y, w in zip(ys[j:k + 1], ws[j:k + 1])) / sum(ws[j:k + 1])

        # the closed form of the least-squares non-decreasing fit
        want = [max(min(avg(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert all(a <= b for a, b in zip(got, got[1:]))
    assert _isotonic([1.0, 3.0, 2.0], [1.0, 1.0, 1.0]) == [1.0, 2.5, 2.5]


def test_curve_knots_and_predictions_equal_a_from_scratch_fit():
    rng = random.Random(1)
    curve = _Curve(64, cap=8.0)
    probes = np.array([0.0, 0.5, 1.0, 3.0, 7.5, 20.0, 63.0, 64.0, 90.0, 500.0])
    for i in range(400):
        x = rng.choice([rng.randrange(-3, 80), rng.randrange(10, 20)])  # out of range: clamped
        curve.observe(x, rng.uniform(-2.0, 30.0))
        assert curve.xs == np.flatnonzero(np.array(curve.weight)).tolist()
        if i % 7 == 0:
            got = curve.predict(probes)
            assert np.array_equal(got, _reference_curve_predict(curve, probes))
            # the hint path (extremes given by the caller) gives the same doubles
            assert np.array_equal(curve.predict(probes, float(probes.min()), float(probes.max())), got)
            inner = probes[(probes >= curve.xs[0]) & (probes <= curve.xs[-1])]
            if len(inner):  # no extrapolation needed: the np.where branches are skipped
                assert np.array_equal(curve.predict(inner), _reference_curve_predict(curve, inner))
    restored = _Curve(64, cap=8.0)
    restored.load_state_dict(curve.state_dict())
    assert restored.xs == curve.xs and np.array_equal(restored.predict(probes), curve.predict(probes))


def test_step_ms_equals_the_from_scratch_formula_inside_and_outside_the_draft_range():
    rng = random.Random(2)
    model = StepCostModel()
    assert np.array_equal(model.per_seq.predict(np.array([[3.0]])), np.zeros((1, 1)))
    _observe_noisy_roofline(model, rng, 3, range(8, 9))  # one batch size: single-knot curves
    for sizes in ([8.0], [4.0, 8.0, 12.0]):
        assert np.array_equal(model.step_ms(np.array(sizes), 4), _reference_step_ms(model, np.array(sizes), 4))
    _observe_noisy_roofline(model, rng, 2000, range(6, 30))
    for sizes in ([6.0, 7.0, 8.0], [10.0, 11.0, 15.0, 16.0], [1.0, 2.0], [29.0, 30.0, 31.0, 60.0], [3.0, 50.0]):
        s = np.array(sizes)
        for gamma_max in (0, 2, 4, 6):
            assert np.array_equal(model.step_ms(s, gamma_max), _reference_step_ms(model, s, gamma_max))


def test_timeline_support_cache_and_catchup_equal_a_recomputation():
    rng = random.Random(3)
    tl = _Timeline(17, 64, arm=1, arms=5)
    for i in range(3000):
        tl.observe(rng.choice([17, 18, 20, 40, 64, 99]), rng.randrange(5), rng.choice([0.0, 0.0, 3.5]))
        if i == 1500:
            tl.catchup_scale = tl.hist_scale = 2e9  # force the renormalisation path
            tl.observe(20, 0, 0.0)
        if i % 50 == 0:
            hist = np.array(tl.hist)
            keep = np.flatnonzero(hist >= 0.02 * hist.max())
            sizes, weights = tl.support()
            assert tl.support() is tl.support()  # cached between two observations
            assert np.array_equal(sizes, (keep + tl.lo).astype(float))
            assert np.array_equal(weights, hist[keep] / hist[keep].sum())
            expected = np.asarray(tl.catchup) / (np.asarray(tl.recent_plays) + 20.0 * tl.catchup_scale)
            assert np.array_equal(tl.catchup_per_step(), expected)
    assert tl.hist_scale < 1e9  # the forced renormalisation happened


def test_bucket_table_agrees_with_bisect_for_every_batch_size():
    for buckets in ((1, 2, 4, 8, 16, 32, 64), (3, 10), (5,)):
        policy = NightjarPolicy(gamma_max=4, buckets=buckets, max_batch=40)
        for tl in policy.timelines:
            tl.arm = policy.timelines.index(tl)  # a distinct arm per bucket shows which one answers
        for b in range(-2, 300):
            assert policy.gamma_for(b) == bucket_index(policy.buckets, b)
