"""``ema`` (SGLang's --speculative-adaptive): tiers by batch size, an EMA of accepted length."""

from __future__ import annotations

import pytest

from planner_svc.policies import make_policy
from planner_svc.policies.ema import EmaPolicy, EmaSettings, EmaTier
from tests.planner_svc.conftest import stats


def feed(policy, batch: int, accepted_per_request: int, steps: int) -> None:
    for _ in range(steps):
        g = policy.gamma_for(batch)
        k = min(g, accepted_per_request)  # every request accepts its first k drafts
        policy.update(stats(batch, g, accepted=tuple(batch if i < k else 0 for i in range(g))))


def test_tiers_start_in_the_middle_and_cap_at_gamma_max():
    p = make_policy("ema", gamma_max=4)
    assert isinstance(p, EmaPolicy)
    # tier 1: {1, 3, 5, 7} capped to {1, 3, 4} -> 3; tier 8: {0, 1, 3} -> 1; tier 32: {0, 1} -> 1; 64+: 0
    assert [p.gamma_for(b) for b in (1, 7, 8, 31, 32, 63, 64, 500)] == [3, 3, 1, 1, 1, 1, 0, 0]


def test_full_acceptance_climbs_and_rejection_descends_within_the_tier():
    p = make_policy("ema", gamma_max=7)
    feed(p, 1, 7, 200)
    assert p.gamma_for(1) == 7 and p.gamma_for(8) == 1  # another tier learned nothing
    feed(p, 1, 0, 200)
    assert p.gamma_for(1) == 1  # its floor: tier 1 never turns speculation off


def test_zero_acceptance_turns_a_middle_tier_off_then_it_probes_back():
    p = make_policy("ema", gamma_max=4)
    feed(p, 12, 0, 15)
    assert p.gamma_for(12) == 0  # the first recompute (warm-up 10, interval 5) turned it off
    seen = []
    for _ in range(20):  # from γ = 0 each recompute probes the next candidate up, and drops back
        feed(p, 12, 0, 1)
        seen.append(p.gamma_for(12))
    assert set(seen) == {0, 1} and seen.count(0) == seen.count(1)


def test_no_change_before_warmup_and_between_intervals():
    p = EmaPolicy(EmaSettings(warmup=10, interval=5), gamma_max=7)
    assert p.gamma_for(1) == 5  # the middle of {1, 3, 5, 7}
    feed(p, 1, 7, 14)
    assert p.gamma_for(1) == 5  # warm-up, then the first recompute at step 15
    feed(p, 1, 7, 1)
    assert p.gamma_for(1) == 7


def test_state_round_trips_and_settings_validate():
    p = make_policy("ema", gamma_max=4)
    feed(p, 1, 4, 100)
    q = make_policy("ema", gamma_max=4)
    q.load_state_dict(p.state_dict())
    assert q.table() == p.table() and q.slots[0].ema == p.slots[0].ema
    with pytest.raises(ValueError, match="ascending"):
        EmaSettings(tiers=(EmaTier(8, (0,)), EmaTier(1, (1,))))
    with pytest.raises(ValueError, match="batch 1"):
        EmaSettings(tiers=(EmaTier(2, (1,)),))
