"""Unit tests of the γ policies: pure logic fed with hand-built StepStats (no simulator)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

from nightjar.messages import Residency
from planner_svc.policies import Context, NightjarPolicy, make_policy
from planner_svc.policies.acceptance_estimate import AcceptanceEstimate
from planner_svc.policies.residency import ResidencyController, ResidencySettings
from planner_svc.policies.step_cost_model import StepCostModel, StepCostSettings
from planner_svc.simulator import load_table
from tests.planner_svc.conftest import stats

ALL_SPECS = ["nightjar", "nightjar-nooffload", "off", "fixed:3", "threshold:8", "table:1=4,4=2,16=1,32=0", "ucb",
             "heuristic", "ema"]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_spec_builds_and_answers_within_range(spec):
    policy = make_policy(spec, gamma_max=4, seed=1)
    assert len(policy.table()) == len(policy.buckets) == 7
    for b in (1, 3, 9, 40, 500):
        decision = policy.select(Context(b, "w0"))
        assert 0 <= decision.gamma <= 4 and decision.residency == Residency.RESIDENT


def test_static_specs_mean_what_they_say():
    assert make_policy("off", gamma_max=4).table() == (0,) * 7
    assert make_policy("fixed:2", gamma_max=4).table() == (2,) * 7
    threshold = make_policy("threshold:8", gamma_max=4)
    assert [threshold.gamma_for(b) for b in (1, 8, 9, 100)] == [3, 3, 0, 0]
    assert make_policy("threshold:4:1", gamma_max=4).gamma_for(4) == 1
    table = make_policy("table:1=4,4=2,16=1,32=0", gamma_max=4)
    assert [table.gamma_for(b) for b in (1, 2, 4, 5, 16, 17, 32, 1000)] == [4, 2, 2, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("spec, match", [
    ("bogus", "unknown policy spec"), ("fixed:x", "integer"), ("fixed:5", "0..4"), ("table:1-4", "batch=gamma"),
    ("table:4=1,4=2", "distinct"), ("threshold:0", "B >= 1"), ("nightjar:3", "unknown"), ("table:1=9", "gamma_max"),
])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec, gamma_max=4)


def test_ucb_tries_every_arm_then_settles_on_the_best():
    policy = make_policy("ucb", gamma_max=3, seed=0)
    rates = {0: 1.0, 1: 1.6, 2: 2.0, 3: 1.2}  # tokens per ms of each arm
    seen = set()
    for _ in range(400):
        g = policy.gamma_for(1)
        seen.add(g)
        policy.update(stats(1, g, verify_ms=10.0, emitted=int(10 * rates[g])))
    assert seen == {0, 1, 2, 3}
    assert policy.plays[2] > 0.6 * sum(policy.plays)


def test_heuristic_adds_two_on_full_acceptance_and_drops_one_otherwise():
    policy = make_policy("heuristic", gamma_max=6)
    assert policy.gamma_for(1) == 6
    policy.update(stats(2, 6, accepted=(2, 2, 1, 0, 0, 0)))
    assert policy.gamma_for(1) == 5
    policy.update(stats(2, 5, accepted=(2, 2, 2, 2, 2)))
    assert policy.gamma_for(1) == 6
    for _ in range(10):
        policy.update(stats(2, policy.gamma_for(1), accepted=(0,) * 6))
    assert policy.gamma_for(1) == 1  # transformers' schedule never turns speculation off


def test_acceptance_estimate_learns_per_position_rates_and_extrapolates():
    rng = np.random.default_rng(0)
    alphas = [0.9, 0.6, 0.5]
    est = AcceptanceEstimate(gamma_max=4)
    for _ in range(300):
        alive, row = 16, []
        for a in alphas:
            alive = rng.binomial(alive, a)
            row.append(alive)
        est.observe(16, 3, tuple(row))
    got = est.alphas()
    assert np.allclose(got[:3], alphas, atol=0.05)
    assert abs(got[3] - got[2]) < 0.05  # never observed: borrows the previous position's rate
    e = est.expected_tokens()
    assert e[0] == 1.0 and e[1] == pytest.approx(1 + got[0]) and e[2] == pytest.approx(1 + got[0] + got[0] * got[1])


def test_step_cost_model_shares_verify_cost_across_arms():
    """γ=0 steps at B=4..32 (n = B tokens) predict the verify cost of γ=3 at B=8 (n = 32)."""
    model = StepCostModel()
    roof = lambda n: 1.0 + max(4.0, 0.25 * n)  # noqa: E731
    for b in (4, 8, 16, 32):
        for _ in range(5):
            model.observe(b, 0, 0.0, roof(b))
    model.observe(2, 1, 1.0, roof(4))  # one draft pass measured: d(2) = 1 ms
    pred = model.step_ms(np.array([8.0]), 3)  # [1, 4]
    assert pred[0, 3] == pytest.approx(roof(32) + 3 * 1.0, rel=0.05)
    # above the largest observation it extrapolates between flat and proportional
    high = model.step_ms(np.array([64.0]), 0)[0, 0]
    assert roof(32) <= high <= roof(32) * 2 + 1e-9


def test_a_cell_not_observed_for_a_while_is_repriced_by_its_next_observations():
    """A cell's weight halves per half-life of steps without it: 8 fresh steps of an arm last
    measured 2,000 steps ago replace its old figure, where a running mean over 64 would have moved
    an eighth of the way; a cell observed every step stays a mean over the last 64."""
    model = StepCostModel(StepCostSettings(half_life_steps=256))
    for _ in range(64):
        model.observe(48, 0, 0.0, 100.0)  # γ=0 at batch 48, in a slow minute
    for _ in range(2000):
        model.observe(48, 1, 10.0, 150.0)  # then γ=1 only
    for _ in range(8):
        model.observe(48, 0, 0.0, 80.0)  # a probe of γ=0
    assert model.step_ms(np.array([48.0]), 1)[0, 0] == pytest.approx(80.0, rel=0.03)
    assert model.step_ms(np.array([48.0]), 1)[0, 1] == pytest.approx(160.0, rel=0.01)
    state = model.state_dict()
    restored = StepCostModel(StepCostSettings(half_life_steps=256))
    restored.load_state_dict(state)
    assert restored.clock == model.clock and restored.verify.last[48] == model.verify.last[48]
    with pytest.raises(ValueError, match="half_life_steps"):
        StepCostSettings(half_life_steps=0)


def test_the_draft_cost_is_affine_in_gamma_and_a_deeper_gamma_is_priced_from_another_batch():
    # Live (seventh session): the draft's first pass costs 2-3x each later one, so its step at
    # batch 4 read 3.0 / 4.8 ms at γ = 1 / 3. After a long batch-1 phase at γ = 4, the 4-client
    # bucket played γ = 1 and a per-pass model priced γ = 3's draft at 3 · 3.0 = 9 ms there.
    def draft(b: int, g: int) -> float:
        return (2.0 + 0.25 * b) + (g - 1) * (0.3 + 0.15 * b) if g else 0.0

    model = StepCostModel()
    for _ in range(10):
        model.observe(1, 1, draft(1, 1), 7.0)
    for _ in range(200):
        model.observe(1, 4, draft(1, 4), 7.0)  # the 1-client phase
        model.observe(4, 1, draft(4, 1), 8.0)  # the 4-client bucket at γ = 1

    def predicted_draft() -> np.ndarray:  # [γ+1]: the step minus its verify part
        n = np.array([4.0 * (g + 1) for g in range(5)])
        return model.step_ms(np.array([4.0]), 4)[0] - model.verify.predict(n) - model.per_seq.predict(np.array([4.0]))

    assert predicted_draft()[0] == pytest.approx(0.0, abs=1e-9)
    assert predicted_draft()[1] == pytest.approx(draft(4, 1), rel=1e-6)
    # γ = 3 at batch 4: the first pass as measured there, the later ones scaled from batch 1
    # (by the target's curve, 7 ms at both here): 3.0 + 2 · 0.45, not 3 · 3.0
    assert predicted_draft()[3] == pytest.approx(draft(4, 1) + 2 * (draft(1, 4) - draft(1, 1)) / 3, rel=0.02)
    # once deeper γ are measured at batch 4 too, every arm's draft there is its own
    for _ in range(200):
        for g in (2, 3):
            model.observe(4, g, draft(4, g), 8.0)
    np.testing.assert_allclose(predicted_draft(), [draft(4, g) for g in range(5)], rtol=1e-6)


@pytest.mark.parametrize("machine", [3.0, 1.0, 0.5])
def test_a_prior_measured_on_another_machine_is_rescaled_by_the_first_live_steps(machine):
    # Eighth session: the shipped surface came from a CPU about 3x faster than the one serving.
    # Live steps replaced the prior where they fell, but every arm and batch not yet played kept
    # the prior's third of its cost, so nightjar chose by a mix of two machines' figures.
    from nightjar.paths import COST_SURFACES

    prior = load_table(COST_SURFACES / "cpu_serve.json", max_batch=256).prior()
    policy = NightjarPolicy(gamma_max=4)
    policy.warm_start(prior)
    sizes = np.array([32.0, 64.0])
    before = policy.cost.step_ms(sizes, 4)  # [2, γ+1]
    for i in range(policy.settings.prior_fit_steps):  # pure decode at batch 1 and 2, γ = 3
        b = 1 + i % 2
        policy.update(stats(b, 3, verify_ms=prior.verify_ms[b - 1][3] * machine,
                            draft_ms=prior.draft_ms[b - 1][3] * machine, accepted=(1, 1, 0)))
    # batch 32 and 64 were never played: priced on this machine's scale
    np.testing.assert_allclose(policy.cost.step_ms(sizes, 4), before * machine, rtol=0.05)


def test_one_gamma_played_at_a_batch_with_noisy_steps_does_not_ratchet_the_per_batch_term():
    # Live, a bucket played γ = 2 at batch 16 for minutes; r(16) climbed to 7-10 ms (about 3
    # where probes' steps put it), so every arm there carried a few ms too many and γ = 0, with
    # the fewest tokens per step, looked 30% dearer than it ran. The cause was a bound at 0 on
    # each residual r learned from. Here the truth is known: verify = 8 + 0.45·n + 0.2·B.
    import random

    def truth(b: int, g: int) -> tuple[float, float]:  # (verify, draft) ms
        return 8 + 0.45 * b * (g + 1) + 0.2 * b, g * (1.5 + 0.25 * b)

    rng, model = random.Random(1), StepCostModel()
    for i in range(20_000):
        if i < 600:  # a cold start tries every arm at a few batch sizes
            b, g = rng.choice([1, 2, 4, 8, 16]), rng.randrange(5)
        else:  # then γ = 2 at batch 16, with a probe of γ = 0 or 1 one step in fifty
            b, g = (16, 2) if rng.random() > 0.02 else (16, rng.choice([0, 1]))
        verify, draft = truth(b, g)
        model.observe(b, g, draft * rng.uniform(0.65, 1.35), verify * rng.uniform(0.65, 1.35))
    predicted = model.step_ms(np.array([16.0]), 4)[0]  # [γ+1]
    true = np.array([sum(truth(16, g)) for g in range(5)])
    assert np.all(np.abs(predicted[:3] / true[:3] - 1) < 0.03), predicted / true  # was 1.057 for γ = 0
    assert 0 <= model.per_seq.value(16) < 2 * 0.2 * 16  # was 10.6 ms against 3.2 true


def test_nightjar_state_round_trips_through_msgpack():
    policy = make_policy("nightjar", gamma_max=4, seed=3)
    for i in range(500):
        b = 1 + i % 40
        g = policy.gamma_for(b)
        policy.update(stats(b, g, verify_ms=1 + max(4, 0.25 * b * (g + 1)), draft_ms=0.8 * g,
                            accepted=tuple(max(b - k * b // 4, 0) for k in range(1, g + 1))))
    blob = msgpack.packb(policy.state_dict(), use_bin_type=True)
    fresh = make_policy("nightjar", gamma_max=4, seed=3)
    fresh.load_state_dict(msgpack.unpackb(blob, raw=False))
    assert fresh.table() == policy.table()
    assert np.allclose(fresh.losses(2), policy.losses(2))
    assert fresh.updates == policy.updates == 500


def test_nightjar_ignores_malformed_stats():
    policy = make_policy("nightjar", gamma_max=4)
    before = policy.table()
    policy.update(stats(0, 1))
    policy.update(stats(4, 9))
    policy.update(stats(4, 1, verify_ms=-1.0))
    policy.update(stats(4, 1, verify_ms=float("nan")))
    policy.update(stats(4, 1, draft_ms=float("inf")))
    assert policy.updates == 0 and policy.table() == before


def test_a_catch_up_is_charged_at_the_batch_where_speculation_resumed():
    # 48 clients in lockstep: the batch sits at 48 with γ = 0, and when every request ends at
    # once it dips for a step to 30, whose bucket speculated and paid the whole context's catch-up.
    # That cost belongs to the dip's arm: charged to bucket 33-64's γ = 0 instead, it made the
    # busy bucket's γ = 0 look dear and the dip kept speculating (two switches a wave).
    policy = make_policy("nightjar", gamma_max=4)
    busy, dip = policy._bucket_of[48], policy._bucket_of[30]
    for _ in range(50):
        policy.update(stats(48, 0, verify_ms=35.0))
    policy.update(stats(30, 3, verify_ms=60.0, draft_ms=6.0, accepted=(20, 15, 10), emitted=75,
                        catchup_ms=110.0, catchup_tokens=1200))
    assert policy.timelines[dip].catchup_per_step()[3] > 0
    assert policy.timelines[busy].catchup_per_step()[0] == 0
    for _ in range(50):  # speculation since: the draft's prompt prefills are this arm's running cost
        policy.update(stats(30, 3, verify_ms=60.0, draft_ms=6.0, accepted=(20, 15, 10), emitted=75,
                            catchup_ms=2.0, catchup_tokens=30))
    assert policy.timelines[busy].catchup_per_step()[0] == 0


def _pressure(controller: ResidencyController, n: int, *, full: bool, waiting: int, batch: int = 40,
              gain: float = 0.0, offload: float = 0.1, residency: str = Residency.RESIDENT) -> None:
    for _ in range(n):
        used, free = (95, 5) if full else (20, 80)
        controller.observe(stats(batch, 0, used=used, free=free, waiting=waiting, residency=residency),
                           lambda b: gain, lambda b, b2: offload, 0.01)


def test_offload_needs_sustained_pressure_and_a_predicted_gain():
    s = ResidencySettings(min_dwell_steps=100)
    ctl = ResidencyController(s)
    for _ in range(20):  # pressure that comes and goes never builds up
        _pressure(ctl, 5, full=True, waiting=3)
        _pressure(ctl, 10, full=False, waiting=0)
    assert ctl.directive("w0") == Residency.RESIDENT
    _pressure(ctl, 200, full=True, waiting=3, offload=-0.05)  # speculating at today's batch beats γ=0 at the grown one
    assert ctl.directive("w0") == Residency.RESIDENT
    _pressure(ctl, 200, full=True, waiting=3, offload=0.05)
    assert ctl.directive("w0") == Residency.OFFLOADED


def test_a_pool_that_keeps_a_queue_waiting_is_pressure_below_90_percent_used():
    """Live, a pool that limits admission read below 90% used in up to a third of its steps (the next
    prompt does not fit, preemptions free blocks); at a 0.9 threshold the burst never offloaded."""
    def run(used: int) -> str:
        ctl = ResidencyController(ResidencySettings(min_dwell_steps=100))
        for i in range(600):  # two steps in three at 91% used, one at `used`%, a queue throughout
            u = 91 if i % 3 else used
            ctl.observe(stats(40, 0, used=u, free=100 - u, waiting=30), lambda b: 0.0, lambda b, b2: 0.1, 0.01)
        return ctl.directive("w0")

    assert run(85) == Residency.OFFLOADED
    assert run(60) == Residency.RESIDENT  # a pool a third of the time well short of full is not what holds the batch
    with pytest.raises(ValueError, match="kv_full_fraction"):
        ResidencySettings(kv_full_fraction=0.0)


def test_no_offload_where_a_bigger_batch_buys_no_throughput():
    """Compute-bound steps: the freed KV would only trade queueing for slower decoding."""
    ctl = ResidencyController(ResidencySettings(min_dwell_steps=100))
    _pressure(ctl, 300, full=True, waiting=3, offload=0.0)
    assert ctl.directive("w0") == Residency.RESIDENT
    _pressure(ctl, 300, full=True, waiting=3, offload=0.05)
    assert ctl.directive("w0") == Residency.OFFLOADED


def test_no_offload_where_speculation_pays_at_the_grown_batch():
    """The draft would be reloaded as soon as the batch grew."""
    ctl = ResidencyController(ResidencySettings(min_dwell_steps=100))
    for _ in range(300):
        ctl.observe(stats(40, 0, used=95, free=5, waiting=30), lambda b: 0.0 if b <= 40 else 0.3, lambda b, b2: 0.1, 0.01)
    assert ctl.directive("w0") == Residency.RESIDENT


def test_the_grown_batch_stops_at_the_workers_max_running():
    """A worker at its batch cap gains nothing from more KV: the freed memory admits no one."""
    seen: list[tuple[int, int]] = []

    def offload_gain(b: int, grown: int) -> float:
        seen.append((b, grown))
        return 0.1 if grown > b else 0.0

    def run(max_running: int) -> str:
        ctl = ResidencyController(ResidencySettings(min_dwell_steps=100))
        for _ in range(300):
            ctl.observe(stats(60, 0, used=95, free=5, waiting=30).replace(max_running=max_running),
                        lambda b: 0.0, offload_gain, 0.01)
        return ctl.directive("w0")

    assert run(0) == Residency.OFFLOADED and seen[-1] == (60, 90)  # no cap said: growth x1.5
    assert run(64) == Residency.OFFLOADED and seen[-1] == (60, 64)
    assert run(60) == Residency.RESIDENT and seen[-1] == (60, 60)


def test_offload_gain_weighs_gamma_zero_at_the_grown_batch_against_the_best_gamma_now():
    # The measured serve surface: at batch 16 speculation still pays (γ=1, +10%), yet γ=0 at the
    # batch 1.45x the KV admits delivers 18% more tokens/s. At batch 8 speculating beats γ=0 at
    # 12 only by a little, but speculation still pays at 12, so the offload would not last.
    surface = load_table(Path(__file__).resolve().parents[2] / "planner_svc" / "cost_surfaces" / "cpu_serve.json", max_batch=256)
    policy = make_policy("nightjar", gamma_max=4)
    policy.warm_start(surface.prior())
    assert policy.gain(16) > 0.05 and policy.gamma_for(16) > 0
    assert policy.offload_gain(16, 23) > 0.1 and policy.gain(23) <= 0.02
    assert policy.gain(12) > 0.02
    assert policy.offload_gain(16, 16) == 0.0


def test_a_silent_worker_leaves_the_residency_table():
    """A dead worker must not stay in every published policy (the planner's clock is the steps')."""
    ctl = ResidencyController(ResidencySettings(min_dwell_steps=100, forget_after_ms=60_000))
    _pressure(ctl, 300, full=True, waiting=3)  # w0 offloaded at unix_ms 0, then silent
    assert ctl.directive("w0") == Residency.OFFLOADED
    for t in range(0, 80_000, 500):  # w1 steps on for 80 s (silence is checked every quarter of the limit)
        ctl.observe(stats(4, 0, worker="w1").replace(unix_ms=t), lambda b: 0.0, lambda b, b2: 0.0, 0.01)
        if t == 59_500:
            assert set(ctl.workers) == {"w0", "w1"}  # not before forget_after_ms
    assert set(ctl.workers) == {"w1"} and ctl.directive("w0") == Residency.RESIDENT
    restored = ResidencyController(ctl.settings)
    restored.load_state_dict(ctl.state_dict())
    assert restored.workers["w1"].last_step_ms == ctl.workers["w1"].last_step_ms > 0


def test_reload_needs_calm_fit_and_gain_with_dwell():
    ctl = ResidencyController(ResidencySettings(min_dwell_steps=100))
    _pressure(ctl, 300, full=True, waiting=3)
    assert ctl.directive("w0") == Residency.OFFLOADED
    _pressure(ctl, 300, full=False, waiting=0, batch=2, gain=0.0, residency=Residency.OFFLOADED)
    assert ctl.directive("w0") == Residency.OFFLOADED  # nothing to gain: stays offloaded
    _pressure(ctl, 300, full=False, waiting=0, batch=2, gain=0.5, residency=Residency.OFFLOADED)
    assert ctl.directive("w0") == Residency.RESIDENT
    assert ctl.workers["w0"].offloads == 1 and ctl.workers["w0"].reloads == 1


def test_nightjar_nooffload_never_directs_an_offload():
    policy = make_policy("nightjar-nooffload", gamma_max=4)
    assert isinstance(policy, NightjarPolicy)
    for _ in range(2000):
        policy.update(stats(64, policy.gamma_for(64), verify_ms=17.0, used=99, free=1, waiting=10))
    assert policy.residency_for("w0") == Residency.RESIDENT and policy.residency() == {}


def test_step_cost_model_separates_prefill_rows_in_mixed_steps():
    """The engine runs new prompts in the decode step's target forward: verify = v(n) + c·prefill."""
    model = StepCostModel()
    roof = lambda n: 1.0 + max(4.0, 0.25 * n)  # noqa: E731
    for b in (16, 32, 48):
        for _ in range(6):
            model.observe(b, 0, 0.0, roof(b))
    for _ in range(10):
        for b in (16, 32, 48):
            model.observe_mixed(b, 0, 0.0, roof(b) + 0.1 * 200, prefill_tokens=200)
    assert model.prefill_ms_per_token == pytest.approx(0.1, rel=0.05)
    for _ in range(6):  # B=24 only ever seen in mixed steps still teaches v(24) ...
        assert model.observe_mixed(24, 0, 0.0, roof(24) + 0.1 * 100, prefill_tokens=100)
    assert model.verify.mean[24] == pytest.approx(roof(24), rel=0.05)
    # ... but not a step that is mostly prefill: its rows cost 0.13 ms here against the 0.1
    # learned, and that error (12 ms) is larger than v(24) itself
    for _ in range(6):
        assert not model.observe_mixed(24, 0, 0.0, roof(24) + 0.13 * 400, prefill_tokens=400)
    assert model.verify.mean[24] == pytest.approx(roof(24), rel=0.05)


def test_step_cost_model_extrapolates_below_the_observed_range_optimistically():
    model = StepCostModel()
    roof = lambda n: 1.0 + max(4.0, 0.25 * n)  # noqa: E731
    for n in (64, 72, 80, 96):  # only large steps seen so far (γ>0 at a big batch)
        model.verify.observe(n, roof(n))
    below = float(model.verify.predict(np.array([40.0]))[0])
    assert below == pytest.approx(roof(40), rel=0.05) and below < roof(64)


def test_probes_price_an_arm_far_below_the_seen_token_counts_at_the_roofline_floor():
    # Only γ = 2 played at batch 64 (n = 186-192): the fitted low slope of so narrow a range is
    # noise (here flat), so γ = 0's n = 64 looks as dear as n = 186. The optimistic prediction
    # takes the roofline's lowest (v proportional to n) and so never prices it above the truth.
    model = StepCostModel()
    rng = np.random.default_rng(0)
    for _ in range(40):
        for n in (186, 189, 192):
            model.verify.observe(n, 80.0 + rng.normal(0, 0.5))
    fitted = float(model.verify.predict(np.array([64.0]))[0])
    hopeful = float(model.verify.predict(np.array([64.0]), optimistic=True)[0])
    assert hopeful < fitted
    assert hopeful == pytest.approx(80.0 * 64 / 186, rel=0.05)
    step = model.step_ms(np.array([64.0]), 2, optimistic=True)[0]  # [3]
    assert step[0] < model.step_ms(np.array([64.0]), 2)[0][0]
