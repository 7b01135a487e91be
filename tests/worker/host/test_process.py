"""EngineProcess: the engine loop in a child process, driven over frames of protocol records (real models)."""

from __future__ import annotations

import io
import os
import queue
import signal
import time
from pathlib import Path

import pytest

from nightjar.messages import MessageError, Policy, SamplingParams, StepStats
from tests.conftest import engine, pair, prompt_ids, run_all
from worker.engine.config import EngineConfig
from worker.engine.engine import EngineRequest, RequestOutput
from worker.host.process import (
    FRAME_MAX_BYTES,
    EngineProcess,
    Failed,
    FromChild,
    Ready,
    Start,
    ToChild,
    read_frame,
    write_frame,
)
from worker.host.protocol import Abort, Add, Command, FollowPolicy, SetResidency, Snapshot, StepResult, UpdatePolicy


def _policy(version: int, gamma: int) -> Policy:
    return Policy(version=version, unix_ms=int(time.time() * 1000), ttl_s=60.0, bucket_upper_bounds=(1_000,),
                  gamma_by_bucket=(gamma,))


def _round_trip(record, tp):
    buf = io.BytesIO()
    write_frame(buf, record)
    buf.seek(0)
    return read_frame(buf, tp)


def test_commands_and_results_cross_as_plain_data():
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3)
    for cmd in (Add("r1", [5, 6, 7], params), Abort("r1"), SetResidency("offloaded"), FollowPolicy("w1", 2, 10.0),
                UpdatePolicy(_policy(4, 3)), Start({"target_path": "x", "max_num_seqs": 4}, "DEBUG")):
        assert _round_trip(cmd, ToChild) == cmd
    with pytest.raises(TypeError):
        write_frame(io.BytesIO(), object())
    result = StepResult(
        outputs=[RequestOutput("r1", 3, [11, 12], False, None, 4, 5), RequestOutput("r2", 0, [], True, "stop", 2, 1)],
        stats=StepStats(worker_id="", step=1, unix_ms=2, batch_size=2, gamma=3, draft_ms=1.0, verify_ms=2.0, step_ms=3.5),
        rejected=[("r3", "prompt too long")],
        snapshot=Snapshot(running=2, kv_blocks_free=9, kv_blocks_total=10, gamma=3, draft_residency="resident",
                          memory_bytes=(("target_kv", 100), ("draft_weights", 50))))
    for frame in (result, Ready(result.snapshot), Failed("boom")):
        assert _round_trip(frame, FromChild) == frame


def test_frames_round_trip_and_refuse_oversize_or_torn_input():
    buf = io.BytesIO()
    write_frame(buf, Abort("x"))
    write_frame(buf, SetResidency("resident"))
    buf.seek(0)
    assert read_frame(buf, Command) == Abort("x") and read_frame(buf, Command) == SetResidency("resident")
    assert read_frame(buf, Command) is None
    torn = io.BytesIO(buf.getvalue()[:-2])
    read_frame(torn, Command)
    assert read_frame(torn, Command) is None  # a frame cut short reads as the end, not as garbage
    with pytest.raises(ValueError, match="exceeds"):
        read_frame(io.BytesIO((FRAME_MAX_BYTES + 1).to_bytes(4, "big")), Command)
    with pytest.raises(MessageError):  # a record of the wrong kind is refused, not delivered
        _round_trip(Abort("x"), FromChild)


def _collect(results: queue.Queue, done_ids: set[str], timeout_s: float = 60.0) -> tuple[dict[str, list[int]], list]:
    """Until every id in done_ids finished -> (tokens by id, step stats; the last snapshot last)."""
    out: dict[str, list[int]] = {}
    stats: list = []
    deadline = time.monotonic() + timeout_s
    finished: set[str] = set()
    while finished != done_ids:
        r: StepResult = results.get(timeout=max(0.1, deadline - time.monotonic()))
        for o in r.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        if r.stats is not None:
            stats.append(r.stats)
    return out, stats + [r.snapshot]


def test_greedy_output_matches_the_engine_in_this_process_and_policy_and_residency_reach_it():
    target, draft = pair()
    prompts = prompt_ids(target, 6)
    ref_eng = engine(target, draft, num_threads=1, default_gamma=2)
    ref = run_all(ref_eng, [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=16)) for i, p in enumerate(prompts)])

    results: queue.Queue = queue.Queue()
    proc = EngineProcess(EngineConfig(target_path=target, draft_path=draft, num_threads=1, default_gamma=2), results.put)
    proc.start()
    try:
        assert proc.ready.wait(120) and proc.error is None
        assert proc.snapshot.kv_blocks_total > 0 and proc.pid != os.getpid()
        for i, p in enumerate(prompts):
            proc.submit(Add(f"r{i}", list(p), SamplingParams(max_tokens=16)))
        got, stats = _collect(results, {f"r{i}" for i in range(len(prompts))})
        assert got == ref
        assert all(s.gamma == 2 for s in stats[:-1] if s.batch_size) and len(stats) > 1  # the engine's default γ

        proc.submit(FollowPolicy("w1", 0, 60.0))
        proc.submit(UpdatePolicy(_policy(1, 4)))  # the planner's γ = 4, adopted by the child's own view
        proc.submit(Add("p", list(prompts[0]), SamplingParams(max_tokens=12)))
        got, stats = _collect(results, {"p"})
        assert got["p"] == ref["r0"][:12]
        assert [s.gamma for s in stats[:-1] if s.batch_size][-1] == 4

        proc.submit(SetResidency("offloaded"))
        proc.submit(Add("q", list(prompts[1]), SamplingParams(max_tokens=8)))
        got, stats = _collect(results, {"q"})
        assert got["q"] == ref["r1"][:8]  # plain decoding while the draft is away: same greedy text
        assert stats[-2].draft_residency == "offloaded" and stats[-2].gamma == 0

        proc.submit(Add("long", list(prompts[2]), SamplingParams(max_tokens=10_000, ignore_eos=True)))
        time.sleep(0.5)
        proc.submit(Abort("long"))
        got, stats = _collect(results, {"long"})
        snap = stats[-1]  # the step that ended it: every block free again
        assert 0 < len(got["long"]) < 10_000 and snap.running == 0 and snap.kv_blocks_free == snap.kv_blocks_total
    finally:
        proc.stop()
    assert proc._proc.returncode == 0 and proc.error is None


def test_a_bad_config_and_a_dead_child_are_reported_not_hung(tmp_path):
    target, _ = pair()
    results: queue.Queue = queue.Queue()
    # config.json is there, so EngineConfig's check passes here; the weights are not: the child fails
    broken = tmp_path / "m"
    broken.mkdir()
    (broken / "config.json").write_text((Path(target) / "config.json").read_text())
    proc = EngineProcess(EngineConfig(target_path=str(broken), num_threads=1), results.put)
    proc.start()
    assert proc.ready.wait(120)
    assert proc.error is not None
    proc.stop()

    proc = EngineProcess(EngineConfig(target_path=target, num_threads=1), results.put)
    proc.start()
    assert proc.ready.wait(120) and proc.error is None
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while proc.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "exited with code -9" in str(proc.error)
    assert isinstance(results.get(timeout=5), StepResult)  # the service is woken to notice
    proc.stop()
