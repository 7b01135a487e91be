"""Pure scheduler logic: which worker has the most free capacity."""

from __future__ import annotations

from nightjar.messages import Heartbeat
from scheduler_svc.capacity import CapacityView, free_fraction


def hb(wid, free=100, total=100, running=0, waiting=0, max_running=8, unix_ms=1000) -> Heartbeat:
    return Heartbeat(worker_id=wid, unix_ms=unix_ms, model="m", kv_blocks_free=free, kv_blocks_total=total,
                     running=running, waiting=waiting, max_running=max_running, gamma=0, draft_residency="none")


def test_tightest_resource_decides():
    assert free_fraction(hb("a", free=90, running=6)) == 0.25  # slots are the bottleneck
    assert free_fraction(hb("a", free=10, running=0)) == 0.10  # KV is
    assert free_fraction(hb("a", running=8, waiting=4)) < 0  # overloaded


def test_pick_most_free_and_exclude():
    v = CapacityView()
    v.refresh({"a": hb("a", running=4), "b": hb("b", running=1), "c": hb("c", free=5)})
    assert v.pick() == "b"
    assert v.pick(exclude={"b"}) == "a"
    assert CapacityView().pick() is None


def test_assignments_since_the_heartbeat_spread_a_burst():
    v = CapacityView()
    v.refresh({"a": hb("a"), "b": hb("b")})
    picks = []
    for t in range(8):
        w = v.pick()
        v.assigned(w, 2000 + t)
        picks.append(w)
    assert sorted(picks) == ["a"] * 4 + ["b"] * 4
    # A heartbeat taken after the assignments already counts them: they are not counted twice.
    v.refresh({"a": hb("a", waiting=4, unix_ms=3000), "b": hb("b", waiting=4, unix_ms=1500)})
    assert v.pick() == "a"  # b still carries its 4 assignments made after its (older) beat


def test_dead_workers_leave_the_view():
    v = CapacityView()
    v.refresh({"a": hb("a")})
    v.assigned("a", 5000)
    v.refresh({})
    assert v.pick() is None
