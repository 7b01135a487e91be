"""The simulated worker's fast paths: lazy per-sequence rows, its StepStats, the policy calls it skips."""

from __future__ import annotations

import numpy as np
from msgspec.structs import fields

from nightjar.messages import StepStats
from planner_svc.policies import make_policy
from planner_svc.simulator import SimConfig, roofline, simulate
from planner_svc.simulator.policy_calls import PolicyCalls
from planner_svc.simulator.sim_worker import UniformBuffer
from tests.planner_svc.conftest import Recorder, high_then_low

GAMMA_MAX = 4
SURFACE = roofline(GAMMA_MAX, 256)


def test_records_are_whole_step_stats_and_every_token_is_counted_once():
    # Overload then idle: γ=0 runs (lazy rows), an offload, and a reload that rebuilds the draft's KV.
    config = SimConfig(gamma_max=GAMMA_MAX, noise=0.1)
    policy = Recorder(make_policy("nightjar", gamma_max=GAMMA_MAX))
    result = simulate(high_then_low(2), policy, SURFACE, config)
    seen = policy.seen
    assert result.offloads >= 1 and result.reloads >= 1
    assert any(s.gamma == 0 for s in seen) and any(s.gamma > 0 for s in seen)
    for s in seen:  # built without __init__: still an equal, complete StepStats
        assert type(s) is StepStats and s == StepStats(**{f.name: getattr(s, f.name) for f in fields(StepStats)})
    # The prefill emits each request's first token; decode steps emit the rest, none twice.
    assert sum(s.emitted_tokens for s in seen) == result.output_tokens - result.requests
    # After the reload the draft has seen nothing: its first speculative step catches up on at
    # least one token per live sequence.
    reload_at = next(i for i in range(1, len(seen))
                     if seen[i].draft_residency == "resident" and seen[i - 1].draft_residency == "reloading")
    first = next(s for s in seen[reload_at:] if s.gamma > 0)
    assert first.catchup_tokens >= first.batch_size and first.catchup_ms > 0


def test_policy_calls_skip_only_what_a_policy_does_not_override():
    table = PolicyCalls(make_policy("table:1=4,4=2,16=1,32=0", gamma_max=GAMMA_MAX))
    assert not table.learns and not table.directs and table.residency_for("w0") == "resident"
    assert [table.gamma(b, "w0") for b in (1, 3, 10, 20, 100)] == [4, 2, 1, 0, 0]
    heuristic = make_policy("heuristic", gamma_max=GAMMA_MAX)
    calls = PolicyCalls(heuristic)
    assert calls.learns and not calls.directs
    heuristic.arm = 1
    assert calls.gamma(7, "w0") == 1  # a learning policy is asked on every step, never cached
    nightjar = PolicyCalls(make_policy("nightjar", gamma_max=GAMMA_MAX))
    assert nightjar.learns and nightjar.directs


def test_uniform_pair_reads_the_same_stream_as_take():
    a, b = UniformBuffer(np.random.default_rng(3), size=8), UniformBuffer(np.random.default_rng(3), size=8)
    got, want = [], []
    for k in range(12):  # crosses several refills, mixing pairs with longer takes
        if k % 3 == 2:
            assert a.take(3).tolist() == b.take(3).tolist()
        got.append(a.pair())
        want.append(tuple(b.take(2).tolist()))
    assert got == want
