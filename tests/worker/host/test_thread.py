"""EngineThread: the host's PolicyView (the worker's only one) gives γ and the draft's residency
to the engine, and its version travels in the snapshot; a stub engine records what it is told."""

from __future__ import annotations

import time

from nightjar.messages import Policy
from worker.host.protocol import FollowPolicy, SetResidency, StepResult, UpdatePolicy
from worker.host.thread import EngineThread


class _Memory:
    def parts(self):
        return self

    def as_dict(self) -> dict[str, int]:
        return {"budget": 1}


class _StubEngine:
    """The surface the host loop uses, with no model: it records each residency directive."""

    num_running = num_waiting = kv_blocks_free = 0
    kv_blocks_total = max_context_tokens = 8
    last_stats = None

    def __init__(self) -> None:
        self.directives: list[str] = []
        self.draft_residency = "resident"
        self.policy = None
        self.memory = _Memory()

    def has_unfinished(self) -> bool:
        return False

    def set_gamma_policy(self, fn) -> None:
        self.policy = fn

    def set_draft_residency(self, directive: str) -> None:
        self.directives.append(directive)
        self.draft_residency = directive


def _policy(version: int, residency: dict[str, str], ttl_s: float = 60.0) -> Policy:
    return Policy(version=version, unix_ms=int(time.time() * 1000), ttl_s=ttl_s, bucket_upper_bounds=(1_000,),
                  gamma_by_bucket=(3,), residency=residency)


def _wait(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_the_host_view_gives_gamma_and_residency_and_reports_its_version():
    eng = _StubEngine()
    snaps: list = []

    def deliver(result: StepResult) -> None:
        snaps.append(result.snapshot)

    host = EngineThread(lambda: eng, deliver)
    host.start()
    try:
        assert host.ready.wait(5) and host.error is None and host.snapshot.policy_version == -1
        host.submit(FollowPolicy("w1", 2, None))
        assert _wait(lambda: eng.directives == ["resident"]) and eng.policy(4) == 2  # no policy yet: the default
        host.submit(UpdatePolicy(_policy(3, {"w1": "offloaded"})))
        assert _wait(lambda: eng.directives == ["resident", "offloaded"]) and eng.policy(4) == 3
        assert _wait(lambda: snaps and snaps[-1].policy_version == 3 and snaps[-1].draft_residency == "offloaded")
        host.submit(UpdatePolicy(_policy(2, {})))  # older: the view keeps v3, the engine hears nothing
        time.sleep(0.3)
        assert eng.directives == ["resident", "offloaded"] and snaps[-1].policy_version == 3
        host.submit(UpdatePolicy(_policy(4, {})))
        assert _wait(lambda: eng.directives[2:] == ["resident"])
        host.submit(UpdatePolicy(_policy(5, {"w1": "offloaded"}, ttl_s=0.3)))
        # past its TTL the view answers "resident": the host tells the engine with no command
        assert _wait(lambda: eng.directives[3:] == ["offloaded", "resident"])
        host.submit(SetResidency("offloaded"))  # a directive stands until the view's answer changes
        assert _wait(lambda: eng.directives[5:] == ["offloaded"])
        time.sleep(0.6)  # a few idle wakes of the loop
        assert eng.directives == ["resident", "offloaded", "resident", "offloaded", "resident", "offloaded"]
        assert snaps[-1].policy_version == 5
    finally:
        host.stop()
    assert host.error is None
