"""Elastic memory on the real shipped pair: offload/reload mid-generation keeps greedy output
identical (near-tie rule in tests/conftest.py), squeeze migrates live blocks, the accounting never
exceeds the budget, an unsafe reload is refused, and 50 cycles leak nothing."""

from __future__ import annotations

import random

import pytest
import torch

from nightjar.messages import SamplingParams, StepStats
from tests.conftest import check_greedy, hf_greedy, pair, prompt_ids, run_all
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, EngineRequest

N_TOKENS = 24
LENS = [8 + (i * 5) % 17 for i in range(16)]  # the engine tests' mixed lengths: references are shared


def _engine(kv_mib: int, **kw) -> Engine:
    target, draft = pair()
    return Engine(EngineConfig(target_path=target, draft_path=draft, kv_budget_bytes=kv_mib << 20, num_threads=1,
                               default_gamma=3, **kw))


@pytest.fixture(scope="module")
def roomy() -> Engine:
    return _engine(24)  # ~118 blocks: 16 sequences fit with the draft resident


@pytest.fixture(scope="module")
def tight() -> Engine:
    return _engine(8)  # 39 blocks: 16 sequences only fit once the draft is offloaded


@pytest.fixture(autouse=True)
def _idle_and_resident(request):
    yield
    for name in ("roomy", "tight"):
        if name in request.fixturenames:
            eng = request.getfixturevalue(name)
            eng.set_gamma_policy(lambda b: 3)
            eng.memory.set_directive_source(None)
            for seq in [*eng.scheduler.running, *eng.scheduler.waiting]:  # a failed test may leave work
                eng.abort(seq.request_id)
            while eng.has_unfinished():
                eng.step()
            assert eng.memory.reload() is None
            eng.memory.wait()
            assert eng.memory.state == "resident"


def _requests(n: int = 16):
    prompts = prompt_ids(pair()[0], 20)[4:4 + n]
    return prompts, [EngineRequest(f"r{i}", list(p), SamplingParams(max_tokens=LENS[i])) for i, p in enumerate(prompts)]


def _check_outputs(prompts, out) -> None:
    target = pair()[0]
    for i, p in enumerate(prompts):
        ref_toks, top2 = hf_greedy(target, p, N_TOKENS)
        err = check_greedy((ref_toks[: LENS[i]], top2), out[f"r{i}"])
        assert err is None, f"request {i}: {err}"


def _check_accounting(eng: Engine) -> None:
    """The parts add up to no more than the budget, and each part is what the tensors really hold."""
    mem = eng.memory
    p = mem.parts()
    assert p.total <= p.budget
    kv = eng.runner.kv
    assert p.target_kv == 2 * kv.k.numel() * kv.k.element_size() == kv.num_blocks * mem.target_bpb
    dkv = eng.proposer.runner.kv
    assert p.draft_kv == 2 * dkv.k.numel() * dkv.k.element_size()
    draft_now = sum(t.numel() * t.element_size() for t in eng.proposer.runner.model.tensors())
    if mem.state == "offloaded":
        assert draft_now == 0 and p.draft_weights == 0 and p.draft_kv == 0  # really freed, not just uncounted
        assert eng.runner.blocks.num_blocks > mem.base_blocks
    if mem.state == "resident":
        assert draft_now == p.draft_weights == mem.mover.nbytes
        assert eng.runner.blocks.num_blocks == mem.base_blocks
    assert eng.runner.blocks.num_blocks == kv.num_blocks


def test_offload_reload_cycles_mid_generation_keep_greedy_output(roomy):
    eng = roomy
    rng = random.Random(7)
    eng.set_gamma_policy(lambda b: rng.randint(0, 4))  # γ changes every step, 0 included
    gammas_after_reload: list[int] = []
    catchups: list[int] = []

    def on_step(e, step):
        _check_accounting(e)
        if step in (3, 11, 19):
            e.set_draft_residency("offloaded")
            assert e.memory.state == "offloaded"  # CPU: the copy completes inside the call
        if step in (7, 15):
            e.set_draft_residency("resident")
        st = e.last_stats
        if st is not None:
            if st.gamma and e.memory.reloads:
                gammas_after_reload.append(st.gamma)
                catchups.append(st.catchup_tokens)
            if st.draft_residency != "resident":
                assert st.gamma == 0

    prompts, reqs = _requests()
    out = run_all(eng, reqs, arrive_every=1, on_step=on_step)
    _check_outputs(prompts, out)
    rep = eng.memory.report()
    assert rep.offloads >= 3 and rep.reloads >= 2 and rep.refusals == 0
    assert gammas_after_reload and sum(catchups) > 0  # speculation resumed, with the draft KV rebuilt
    assert rep.state == "offloaded" and eng.kv_blocks_free == eng.kv_blocks_total > rep.base_blocks
    assert eng.memory.reload() is None and eng.memory.state == "resident"
    assert eng.kv_blocks_free == eng.kv_blocks_total == rep.base_blocks


def test_squeeze_migrates_live_blocks_and_keeps_outputs(tight):
    eng = tight
    seen = {"migrated": 0, "running_at_reload": 0}

    def on_step(e, step):
        _check_accounting(e)
        if step == 2:
            e.set_draft_residency("offloaded")
        if step == 6:
            e.set_draft_residency("resident")  # refused at first: the 16 sequences need the big pool
        if e.memory.reloads and not seen["running_at_reload"]:
            seen["running_at_reload"] = e.num_running
            seen["migrated"] = e.memory.last_migrated_blocks

    prompts, reqs = _requests()
    out = run_all(eng, reqs, on_step=on_step)
    _check_outputs(prompts, out)
    rep = eng.memory.report()
    assert rep.reloads >= 1 and rep.refusals >= 1
    assert seen["running_at_reload"] > 0, "the reload should have happened while sequences were still running"
    assert seen["migrated"] > 0, "live blocks above the base pool size should have been migrated"
    assert eng.kv_blocks_free == eng.kv_blocks_total == rep.base_blocks


def test_unsafe_reload_is_refused_without_preempting(tight):
    eng = tight
    refusals0 = eng.memory.refusals
    eng.memory.offload()
    assert eng.memory.state == "offloaded" and eng.kv_blocks_total > eng.memory.base_blocks
    prompts, reqs = _requests()
    for r in reqs:
        eng.add_request(r)
    out: dict[str, list[int]] = {}
    preempted = 0

    def collect():
        nonlocal preempted
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        preempted += eng.last_stats.preempted if eng.last_stats else 0

    while eng.runner.blocks.num_used <= eng.memory.base_blocks:
        collect()
    st = eng.last_stats  # what the planner sees: residency and the budget by part
    assert st.draft_residency == "offloaded" and st.memory_bytes == eng.memory.parts().as_dict()
    assert st.memory_bytes["draft_weights"] == 0 and StepStats.decode(st.encode()).memory_bytes == st.memory_bytes
    assert st.max_running == eng.cfg.max_running  # the planner's grown batch stops there
    why = eng.memory.reload()
    assert why is not None and "preempt" in why
    rep = eng.memory.report()
    assert rep.state == "offloaded" and rep.refusals == refusals0 + 1 and rep.target_blocks > rep.base_blocks
    while eng.has_unfinished():
        collect()
        _check_accounting(eng)
    assert preempted == 0  # the refused reload never took blocks from running work
    assert eng.memory.state == "resident"  # ... and it went through once the blocks were free
    assert eng.memory.report().refusals == refusals0 + 1  # retries of one directive count once
    _check_outputs(prompts, out)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_fifty_cycles_leave_memory_and_blocks_where_they_started(tight):
    eng = tight
    mem = eng.memory
    before = [t.clone() for t in eng.proposer.runner.model.tensors()]
    prompts = prompt_ids(pair()[0], 4)
    n = 0

    def cycle():
        nonlocal n
        if not eng.has_unfinished():
            eng.add_request(EngineRequest(f"c{n}", list(prompts[n % 4]), SamplingParams(max_tokens=6)))
            n += 1
        eng.memory.offload()
        eng.step()
        _check_accounting(eng)
        assert eng.memory.reload() is None
        eng.step()
        _check_accounting(eng)

    for _ in range(3):  # warm-up: host buffers, allocator caches
        cycle()
    rss0 = _rss_bytes()
    for _ in range(50):
        cycle()
    while eng.has_unfinished():
        eng.step()
    grown = _rss_bytes() - rss0
    # A copy kept per cycle would grow RSS by 50 copies; the allocator's free lists and arenas
    # keep a copy or two of slack, so the bound is 3 copies.
    assert grown < 3 * mem.mover.nbytes, f"RSS grew {grown / 2**20:.1f} MiB over 50 cycles (one draft copy is " \
                                         f"{mem.mover.nbytes / 2**20:.1f} MiB)"
    rep = mem.report()
    assert rep.offloads >= 53 and rep.reloads >= 53
    assert rep.target_blocks == rep.base_blocks == eng.kv_blocks_free
    assert rep.draft_blocks == rep.base_blocks == eng.proposer.runner.blocks.num_free
    after = eng.proposer.runner.model.tensors()
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))


def test_directive_source_offloads_under_pressure_and_reloads_when_it_falls(tight):
    eng = tight
    def rule(p):  # offload while requests wait; reload once the base pool would be half empty
        if p.waiting:
            return "offloaded"
        if p.blocks_used <= p.base_blocks // 2:
            return "resident"
        return "offloaded" if p.state in ("offloading", "offloaded") else "resident"

    eng.memory.set_directive_source(rule)
    states = []
    prompts, reqs = _requests()
    out = run_all(eng, reqs, on_step=lambda e, s: states.append(e.memory.state))
    _check_outputs(prompts, out)
    assert "offloaded" in states and eng.memory.state == "resident" and eng.memory.reloads >= 1


def test_invalid_directive_and_too_small_budget_say_how_to_fix():
    eng_cfg = dict(target_path=pair()[0], draft_path=pair()[1], num_threads=1)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        Engine(EngineConfig(**eng_cfg, memory_budget_bytes=10 << 20))
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        EngineConfig(**eng_cfg, memory_budget_bytes=0)


def test_memory_budget_sizes_the_pools_and_is_never_exceeded(tight):
    with pytest.raises(ValueError, match="resident"):
        tight.set_draft_residency("elsewhere")
    budget = 96 << 20
    eng = Engine(EngineConfig(target_path=pair()[0], draft_path=pair()[1], num_threads=1,
                              memory_budget_bytes=budget, workspace_bytes=4 << 20))
    p = eng.memory.parts()
    assert p.budget == budget and p.workspace == 4 << 20
    assert 0 <= p.free < eng.memory.target_bpb + eng.memory.draft_bpb  # the pools take what is left
    base = eng.kv_blocks_total
    eng.memory.offload()
    q = eng.memory.parts()
    assert q.total <= budget and q.free < eng.memory.target_bpb
    gained = eng.kv_blocks_total - base
    # the freed bytes (draft weights + draft pool) become target blocks, to the block
    assert gained == (p.free + p.draft_weights + p.draft_kv) // eng.memory.target_bpb


def test_engine_thread_applies_the_residency_directive_and_reports_memory(tight):
    """The worker service's path: SetResidency on the engine thread -> the engine's manager; the
    snapshot (what heartbeats carry) shows the residency, the grown pool and the parts."""
    import threading
    import time

    from worker.host.protocol import SetResidency
    from worker.host.thread import EngineThread

    got, seen = [], threading.Event()

    def deliver(result):
        got.append(result.snapshot)
        if result.snapshot.draft_residency == "offloaded":
            seen.set()

    th = EngineThread(lambda: tight, deliver)
    th.start()
    try:
        assert th.ready.wait(30) and th.error is None
        th.submit(SetResidency("offloaded"))
        assert seen.wait(10), f"no offloaded snapshot: {got[-1:]}"
        snap = next(s for s in got if s.draft_residency == "offloaded")
        mem = dict(snap.memory_bytes)
        assert snap.kv_blocks_total > tight.memory.base_blocks and mem["draft_weights"] == 0 == mem["draft_kv"]
        assert mem["target_kv"] == snap.kv_blocks_total * tight.memory.target_bpb <= mem["budget"]
        th.submit(SetResidency("resident"))
        deadline = time.monotonic() + 10
        while got[-1].draft_residency != "resident" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got[-1].draft_residency == "resident" and got[-1].kv_blocks_total == tight.memory.base_blocks
    finally:
        th.stop()
