"""nightjar bench: workloads, report maths, step summaries, plots, and the load generator
against a real grpc.aio InferenceService on 127.0.0.1 (a scripted one, in the test's loop)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import msgspec
import numpy as np
import pytest

from nightjar import paths
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, StepStats
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_tools.bench import plots, report
from nightjar_tools.bench.loadgen import LoadConfig, LoadResult, RequestRecord, run_load
from nightjar_tools.bench.probe import StackProbe, bench_source, parse_bench_source, recording, steps_of, summarize_steps
from nightjar_tools.bench.workload import CONTEXT_TOKENS, LengthScale, PromptBank, Workload, build
from worker.engine.linear import can_bf16

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("spec", ["poisson:0.5", "burst", "ramp", "oscillation", "rates:0.2,1,2"])
def test_workload_is_reproducible_per_seed(spec):
    a, b, c = (build(spec, 4.0, 60, seed=s) for s in (3, 3, 4))
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.output_tokens, b.output_tokens)
    assert not np.array_equal(a.arrival_s, c.arrival_s)


def test_poisson_rate_matches_load_times_capacity():
    wl = build("poisson:0.5", 20.0, 200, seed=1)
    expected = 0.5 * 20.0 * 200  # 2000 requests
    assert abs(len(wl) - expected) < 4 * expected ** 0.5
    assert wl.arrival_s.max() < 200 and np.all(np.diff(wl.arrival_s) >= 0)


def test_burst_peak_is_much_denser_than_its_start():
    wl = build("burst", 10.0, 100, seed=0)
    # Pieces of 20 s at loads 0.1, 0.4, 1.2, 2.0, 0.3 × capacity.
    first, peak = wl.offered_rps(0, 20), wl.offered_rps(60, 80)
    assert 0.5 < first < 2.0 and 15 < peak < 25
    assert wl.nominal_rps(10) == pytest.approx(1.0) and wl.nominal_rps(70) == pytest.approx(20.0)


def test_rates_steps_in_order():
    wl = build("rates:0.1,2.0", 10.0, 100, seed=0)
    assert wl.offered_rps(50, 100) > 8 * wl.offered_rps(0, 50)


def test_lengths_are_scaled_and_fit_the_context():
    scale = LengthScale(prompt=0.5, output=0.25, max_output=64)
    wl = build("poisson:1", 50.0, 60, seed=2, scale=scale)
    assert wl.output_tokens.min() >= scale.min_output and wl.output_tokens.max() <= 64
    assert np.all(wl.prompt_tokens + wl.output_tokens < CONTEXT_TOKENS)
    # The simulator's median output is 100 tokens; a quarter of that is ~25.
    assert 15 < np.median(wl.output_tokens) < 35


@pytest.mark.skipif(not (paths.TRACES_DIR / "AzureLLMInferenceTrace_conv.csv").exists(), reason="traces not present")
def test_azure_replay_is_time_scaled_to_the_capacity():
    wl = build("azure_conv", 2.0, 60, azure_load=0.9)
    assert 0.6 * 108 < len(wl) <= 108 + 1  # ~0.9 × 2 req/s × 60 s
    assert wl.arrival_s.max() < 60


def test_bad_specs_say_what_to_write():
    with pytest.raises(ValueError, match="poisson:RHO"):
        build("poisson:x", 1.0, 10)
    with pytest.raises(ValueError, match="rates"):
        build("rates:a,b", 1.0, 10)
    with pytest.raises(ValueError, match="capacity_rps"):
        build("burst", 0.0, 10)
    with pytest.raises(ValueError, match="length scales"):
        LengthScale(prompt=0)


def test_prompt_bank_cuts_texts_of_the_asked_length():
    bank = PromptBank()
    rng = np.random.default_rng(0)
    for n in (8, 64, 300):
        text = bank.text(n, rng)
        assert abs(bank.token_count(text) - n) <= max(3, n // 20)
    wl = Workload("w", np.zeros(3), np.array([10, 20, 30]), np.array([4, 4, 4]), 1.0, 1.0)
    assert bank.texts(wl, seed=5) == bank.texts(wl, seed=5) != bank.texts(wl, seed=6)


# --------------------------------------------------------------------------- report maths


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(1.0, 101))
    for q in (0, 1, 50, 90, 99, 100):
        assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert report.percentile([], 50) is None
    with pytest.raises(ValueError):
        report.percentile(xs, 101)


def _rec(i, sent, first, end, tokens, status="ok") -> RequestRecord:
    return RequestRecord(i, sent, 10, tokens, sent_s=sent, first_token_s=first, end_s=end, completion_tokens=tokens, status=status)


def test_summarize_computes_throughput_and_latencies():
    recs = [_rec(0, 0.0, 0.5, 2.5, 21), _rec(1, 1.0, 2.0, 4.0, 11), _rec(2, 1.0, None, None, 0, "UNAVAILABLE")]
    s = report.summarize(LoadResult("x", "w", 0.0, 4.0, recs))
    assert s["ok"] == 2 and s["sent"] == 3 and s["failed"] == {"UNAVAILABLE": 1}
    assert s["tokens_per_s"] == pytest.approx(32 / 4.0)
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["e2e_s"]["p50"] == pytest.approx(2.75)
    assert s["itl_s"]["mean"] == pytest.approx((2.0 / 20 + 2.0 / 10) / 2)


def test_a_closed_loops_throughput_is_its_steady_rate_not_its_drain():
    # 8 tok/s while all clients send (0-10 s), then a 5 s drain at 2 tok/s; warm-up to 2 s
    samples = [{"t": t / 2, "tokens_per_s": 8.0 if t <= 20 else 2.0} for t in range(1, 31)]
    assert report.steady_tokens_per_s(samples, 2.0, 10.0) == pytest.approx(8.0)
    assert report.steady_tokens_per_s(samples, 9.75, 10.25) == pytest.approx(5.0)  # interpolated inside a sample
    assert report.steady_tokens_per_s(samples, 2.0, 16.0) is None  # the samples end at 15 s
    recs = [_rec(i, 2.0 + i, 2.5 + i, 3.0 + i, 8) for i in range(8)] + [_rec(8, 9.9, 10.0, 15.0, 10)]
    res = LoadResult("x", "closed:4", 0.0, 15.0, recs, samples)
    open_rate, closed = report.summarize(res, warmup_s=2.0), report.summarize(res, warmup_s=2.0, steady_until_s=10.0)
    assert open_rate["tokens_per_s"] == pytest.approx(74 / 13.0) == closed["makespan_tokens_per_s"]
    assert closed["tokens_per_s"] == closed["steady_tokens_per_s"] == pytest.approx(8.0)
    assert "steady_tokens_per_s" not in open_rate


def _run(policy, wl, tps, e2e, ttft):
    return {"policy": policy, "workload": wl, "tokens_per_s": tps, "e2e_s": {"mean": e2e}, "ttft_s": {"p50": ttft}}


def test_goal_rows_compare_nightjar_with_the_right_baseline():
    runs = [_run("nightjar", "burst", 130, 1.0, 0.2), _run("fixed:3", "burst", 100, 2.0, 0.2),
            _run("threshold:4:3", "burst", 128, 1.0, 0.2), _run("ema", "burst", 120, 1.0, 0.2),
            _run("nightjar-nooffload", "burst", 125, 1.2, 0.5), _run("nightjar", "poisson:1.5", 50, 5, 1.0),
            _run("nightjar-nooffload", "poisson:1.5", 50, 5, 2.0), _run("off", "poisson:1.5", 60, 5, 2.0)]
    rows = report.goal_rows(runs, {"burst": "dynamic", "poisson:1.5": "overload"})
    got = {(r["goal"], r["workload"]): r for r in rows}
    assert got[("throughput vs fixed-γ (dynamic)", "burst")]["met"] is True  # 1.30 >= 1.27
    assert got[("mean e2e latency vs fixed-γ (dynamic)", "burst")]["ratio"] == pytest.approx(0.5)
    assert got[("throughput vs threshold (dynamic)", "burst")]["met"] is False  # 1.016 < 1.05
    assert got[("throughput vs ema (dynamic)", "burst")]["met"] is True  # 1.083 >= 1.05
    assert ("throughput vs heuristic (dynamic)", "burst") not in got  # not run: no row
    assert got[("throughput vs off (steady overload)", "poisson:1.5")]["met"] is False  # 0.83
    # TTFT halved, but without a single offload that is not the offload's doing.
    assert got[("TTFT p50, offload vs no offload (overload)", "poisson:1.5")]["met"] is None
    assert "**missed**" in report.markdown_goals(rows) and "no offload happened" in report.markdown_goals(rows)
    assert got[("TTFT p50, offload vs no offload (dynamic)", "burst")]["met"] is None
    runs[5]["engine"] = {"offloads": 1}
    runs[0]["engine"] = {"offloads": 1}
    rows = report.goal_rows(runs, {"burst": "dynamic", "poisson:1.5": "overload"})
    assert [(r["workload"], r["met"]) for r in rows if r["goal"].startswith("TTFT")] == [("poisson:1.5", True), ("burst", True)]
    runs[4]["ttft_s"]["p50"] = 0.25  # 0.2 / 0.25 = 0.8: the offload cut TTFT by only 20%
    assert [r["met"] for r in report.goal_rows(runs, {"burst": "dynamic"}) if r["goal"].startswith("TTFT")] == [False]


def test_goal_rows_average_ratios_within_repeats():
    runs = [_run("nightjar", "burst", 130, 1.0, 0.2), _run("fixed:3", "burst", 100, 2.0, 0.2),
            {**_run("nightjar", "burst", 90, 1.0, 0.2), "repeat": 1}, {**_run("fixed:3", "burst", 100, 2.0, 0.2), "repeat": 1}]
    (row,) = [r for r in report.goal_rows(runs, {"burst": "dynamic"}) if r["goal"].startswith("throughput vs fixed")]
    assert row["ratios"] == pytest.approx([1.3, 0.9]) and row["ratio"] == pytest.approx(1.1) and row["met"] is False
    assert "0.900–1.300, 2 repeats" in report.markdown_goals([row])
    avg = {r["policy"]: r for r in report.average_runs(runs)}
    assert avg["nightjar"]["tokens_per_s"] == pytest.approx(110) and avg["nightjar"]["repeats"] == 2


def test_markdown_summary_gives_means_and_ranges_over_repeats():
    def run(tps, rep):
        recs = [_rec(0, 0.0, 0.5, 2.5, tps)]
        return {**report.summarize(LoadResult("x", "burst", 0.0, 2.5, recs)), "policy": "nightjar", "repeat": rep}

    table = report.markdown_summary([run(20, 0), run(30, 1)])
    assert "**burst**" in table and "| nightjar | 2/2 | 10.0 (8.0–12.0) |" in table


def _step(i, gamma, batch=4, accepted=(), residency="resident", worker="w1", emitted=4):
    return StepStats(worker_id=worker, step=i, unix_ms=i, batch_size=batch, gamma=gamma, draft_ms=1.0, verify_ms=2.0,
                     step_ms=3.0, accepted_per_position=tuple(accepted), emitted_tokens=emitted, draft_residency=residency)


def test_summarize_steps_counts_switches_offloads_and_acceptance():
    steps = [_step(0, 2, accepted=(4, 2)), _step(1, 2, accepted=(4, 4)), _step(2, 0, residency="offloading"),
             _step(3, 0, residency="offloaded"), _step(4, 0, residency="reloading"), _step(5, 1, accepted=(2,)),
             _step(6, 3, accepted=(1, 1, 1), worker="w2"), _step(7, 0, batch=0, worker="w2", emitted=0)]
    s = summarize_steps(steps)
    # w1: 2->0, 0->1; w2's first step is not a switch, nor is its prefill-only step (batch 0).
    assert s["gamma_switches"] == 2
    assert s["offloads"] == 1 and s["reloads"] == 1
    assert s["acceptance"] == pytest.approx((6 + 8 + 2 + 3) / (8 + 8 + 4 + 12))
    assert s["spec_step_share"] == pytest.approx(4 / 7)  # of the decode steps
    assert summarize_steps([])["acceptance"] is None
    steps[3] = msgspec.structs.replace(steps[3], preempted=2, preempted_tokens=40, prefill_tokens=40)
    steps[5] = msgspec.structs.replace(steps[5], prefill_tokens=25)
    s = summarize_steps(steps)
    assert (s["preempted"], s["preempted_tokens"], s["prefill_tokens"]) == (2, 40, 65)


def test_prefill_share_takes_a_mixed_step_less_its_cells_decode_cost():
    decode = [_step(i, 2) for i in range(3)]  # batch 4, γ 2: 3 ms each
    mixed = msgspec.structs.replace(_step(3, 2), prefill_tokens=64, step_ms=10.0)  # 7 ms of prefill
    prefill_only = msgspec.structs.replace(_step(4, 0, batch=0, emitted=0), prefill_tokens=128, step_ms=5.0)
    unseen_gamma = msgspec.structs.replace(_step(5, 4), prefill_tokens=32, step_ms=4.0)  # no pure decode at γ 4: whole
    unseen_bucket = msgspec.structs.replace(_step(6, 2, batch=40), prefill_tokens=16, step_ms=6.0)  # γ 2's nearest: 3 ms
    s = summarize_steps([*decode, mixed, prefill_only, unseen_gamma, unseen_bucket])
    assert s["prefill_share"] == pytest.approx((7.0 + 5.0 + 4.0 + 3.0) / (9.0 + 10.0 + 5.0 + 4.0 + 6.0))
    assert summarize_steps(decode)["prefill_share"] == 0.0


def test_overload_bound_divides_the_baselines_cost_by_the_least_prefill_and_best_decode(tmp_path):
    def run(policy, batch, gamma, decode_ms, mixed_ms, emitted, decode_steps=20):
        steps = [msgspec.structs.replace(_step(i, gamma, batch=batch, emitted=emitted), step_ms=decode_ms)
                 for i in range(decode_steps)]
        steps.append(msgspec.structs.replace(_step(decode_steps, gamma, batch=batch, emitted=emitted), prefill_tokens=100,
                                             step_ms=mixed_ms))
        name = policy.replace(":", "_")
        (tmp_path / f"{name}_burst.json").write_text(json.dumps(recording(steps, bench_source(policy, "burst", 1))))

    run("fixed:4", batch=4, gamma=4, decode_ms=10.0, mixed_ms=30.0, emitted=8)  # 1.25 ms/token; 20 ms of prefill
    run("nightjar", batch=16, gamma=0, decode_ms=8.0, mixed_ms=20.0, emitted=16)  # 0.5 ms/token; 12 ms of prefill
    # 0.0625 ms/token over 5 decode steps, too few for a cell: it must not become the best decode cost.
    run("ucb", batch=16, gamma=0, decode_ms=1.0, mixed_ms=20.0, emitted=16, decode_steps=5)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/overload_bound.py"), str(tmp_path), "--window", "burst=0:2"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    # fixed:4 spends 230 ms on 168 tokens; the least prefill is 12 ms / 336 tokens, the best decode 0.5 ms/token.
    assert f"- burst: {(230 / 168) / (12 / 336 + 0.5):.3f}" in out, out
    # Its prefill share, 20 of 230 ms; its 168 tokens all fall in the first 2 s.
    assert "| burst | fixed:4 | 1 | 0.09 |" in out and "| 84.0 |" in out, out
    assert "| burst | ucb | 1 | 0.76 | 0.20 | 0.06 | – |" in out, out


def test_a_recording_gives_back_every_recorded_field_of_its_steps():
    steps = [_step(0, 2, accepted=(4, 2)), _step(1, 0, residency="offloaded"), _step(2, 0, batch=0, emitted=0)]
    steps[1] = msgspec.structs.replace(steps[1], preempted=3, preempted_tokens=90, step_ms=7.5)
    rec = json.loads(json.dumps(recording(steps, "test")))  # as saved to OUT/steps/
    assert {"step_ms", "preempted", "preempted_tokens"} <= set(rec["fields"]) and rec["draft_residency"][1] == "offloaded"
    assert steps_of(rec) == steps  # the steps' numbers are their places: 0, 1, 2
    assert parse_bench_source(bench_source("fixed:4", "poisson:0.3", 2)) == ("fixed:4", "poisson:0.3", 2)
    assert parse_bench_source("test") is None


# --------------------------------------------------------------------------- plots


def test_plots_write_png_files(tmp_path):
    samples = [{"t": t * 0.5, "offered_rps": t, "running": t, "batch": t, "waiting": 0, "gamma": max(0, 3 - t),
                "residency": "resident" if t < 4 else "offloaded", "kv_blocks_total": 100 + 10 * (t >= 4),
                "kv_blocks_free": 50, "tokens_per_s": 10.0 * t, "e2e_s": 1.0 + t, "ttft_s": 0.1} for t in range(8)]
    tl = plots.timeline(samples, tmp_path / "t.png", "test", capacity_rps=3.0)
    runs = [_run("fixed:3", "burst", 100, 2.0, 0.2), _run("nightjar", "burst", 130, 1.0, 0.2)]
    bars = plots.comparison_bars(runs, tmp_path / "b.png", "fixed:3", "test")
    for path in (tl, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# --------------------------------------------------------------------------- probe (real redis)


async def test_probe_reads_heartbeats_and_only_new_steps(any_redis):
    """On one redis-server, and on a Redis Cluster through a redis+cluster:// URL."""
    from nightjar.service_util import connect_redis

    redis_url, key_prefix = any_redis
    keys = Keys(key_prefix)
    r = connect_redis(redis_url)
    hb = Heartbeat(worker_id="w1", unix_ms=1, model="m", kv_blocks_free=30, kv_blocks_total=100, running=5, waiting=2,
                   max_running=64, gamma=2, draft_residency="resident")
    await r.set(keys.heartbeat("w1"), hb.encode())
    await r.sadd(keys.workers, "w1", "w-dead")  # a dead worker has no heartbeat key
    await r.xadd(keys.stats, {b"s": _step(0, 4).encode()})  # before start: not this run's
    probe = StackProbe(redis_url, key_prefix)
    try:
        await probe.start()
        for i in range(3):
            await r.xadd(keys.stats, {b"s": _step(i + 1, 2, batch=6, accepted=(3, 1)).encode()})
        row = await probe()
        assert row["workers"] == 1 and row["running"] == 5 and row["kv_blocks_total"] == 100
        assert row["residency"] == "resident" and row["steps"] == 3 and row["batch"] == 6 and row["gamma"] == 2
        assert (await probe())["workers"] == 1 and len(probe.steps) == 3  # nothing new the second time
    finally:
        await probe.close()
        await r.aclose()


# --------------------------------------------------------------------------- load generator (real gRPC)


class ScriptedInference(pb_grpc.InferenceServiceServicer):
    """Streams max_tokens tokens, two per response, ``step_s`` apart; "hang" prompts never finish."""

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.prompts: list[str] = []
        self.request_ids: list[str] = []
        self.concurrent = self.peak = 0

    async def Generate(self, request, context):
        self.prompts.append(request.prompt)
        self.request_ids.append(request.request_id)
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            if request.prompt.startswith("hang"):
                await asyncio.sleep(3600)
            sent = 0
            while sent < request.max_tokens:
                await asyncio.sleep(self.step_s)
                n = min(2, request.max_tokens - sent)
                sent += n
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=list(range(n)), text="ab"[:n])
            yield pb.GenerateResponse(request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH,
                                      usage=pb.Usage(prompt_tokens=len(request.prompt.split()), completion_tokens=sent))
        finally:
            self.concurrent -= 1


@pytest.fixture
async def scripted_server():
    server = grpc.aio.server()
    servicer = ScriptedInference()
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_loadgen_replays_the_schedule_and_measures(scripted_server):
    servicer, target = scripted_server
    n = 20
    wl = Workload("t", np.linspace(0, 0.5, n), np.full(n, 3), np.arange(1, n + 1) * 2, 1.0, 1.0)
    prompts = [f"p{i} a b" for i in range(n)]
    calls = []

    async def probe():
        calls.append(1)
        return {"running": 1}

    res = await run_load(wl, prompts, LoadConfig(target=target, sample_interval_s=0.05, progress=False), probe=probe)
    assert sorted(servicer.prompts) == sorted(prompts)
    # The gateway takes at most 64 printable ASCII characters without spaces, unique per request.
    assert len(set(servicer.request_ids)) == n
    assert all(0 < len(r) <= 64 and all(0x21 <= ord(c) <= 0x7E for c in r) for r in servicer.request_ids)
    assert all(r.ok for r in res.records)
    assert [r.completion_tokens for r in res.records] == list(wl.output_tokens)
    assert all(r.prompt_tokens == 3 for r in res.records)
    for r in res.records:
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.sent_s - r.planned_s < 0.25  # the client kept to the schedule
    assert res.records[-1].e2e_s > res.records[0].e2e_s  # 40 tokens take longer than 2
    assert servicer.peak > 1  # open loop: requests overlapped
    assert calls and res.samples and all("running" in s for s in res.samples)
    s = report.summarize(res)
    assert s["tokens_per_s"] > 0 and s["ttft_s"]["p99"] >= s["ttft_s"]["p50"]


async def test_loadgen_is_bounded_in_time_and_count(scripted_server):
    servicer, target = scripted_server
    wl = Workload("t", np.array([0.0, 0.05, 5.0]), np.full(3, 2), np.full(3, 4), 0.2, 1.0)
    t0 = time.monotonic()
    res = await run_load(wl, ["hang now", "ok x", "never sent"],
                         LoadConfig(target=target, max_duration_s=0.2, drain_timeout_s=0.5, progress=False))
    assert time.monotonic() - t0 < 3
    assert [r.status for r in res.records] == ["cancelled", "ok", "not_sent"]
    assert "never sent" not in servicer.prompts
    s = report.summarize(res)
    assert s["sent"] == 2 and s["ok"] == 1 and s["failed"] == {"cancelled": 1}


def test_load_config_rejects_nonsense():
    with pytest.raises(ValueError, match="host:port"):
        LoadConfig(target="localhost")
    with pytest.raises(ValueError, match="drain_timeout_s"):
        LoadConfig(target="h:1", drain_timeout_s=0)


# --------------------------------------------------------------------------- command line


def test_policy_and_workload_specs_resolve():
    from nightjar_tools.bench.cli import _workload, parser
    from nightjar_tools.bench.compare import kind_of, resolve_policy

    assert resolve_policy("fixed:G", 3) == "fixed:3" and resolve_policy("threshold:4:G", 2) == "threshold:4:2"
    assert resolve_policy("table:1=4,4=2", 3) == "table:1=4,4=2"
    assert [kind_of(s) for s in ("poisson:0.3", "poisson:1.5", "burst", "azure_conv", "rates:1,2")] == \
        ["low", "overload", "dynamic", "dynamic", "sweep"]
    plan = _workload("burst@12.5")
    assert plan.spec == "burst" and plan.duration_s == 12.5
    with pytest.raises(SystemExit):
        parser().parse_args(["--workloads", "burst@soon"])


def test_static_peers_read_their_table_off_the_prior_surface(tmp_path):
    from nightjar_tools.bench.compare import CompareConfig, WorkloadPlan, resolve_policy

    surface = [4, 2, 1, 1, 1, 0, 0]  # best γ at batch 1, 2, ...
    assert resolve_policy("table:S", 3, surface) == "table:1=4,2=2,5=1,6=0"
    assert resolve_policy("threshold:S:G", 3, surface) == "threshold:5:3"
    assert resolve_policy("threshold:S", 3, [2, 2]) == "threshold:2"  # no crossover: speculate to the last size
    assert resolve_policy("threshold:S:G", 3, [0, 0]) == "off"
    with pytest.raises(ValueError, match="prior surface"):
        resolve_policy("table:S", 3, None)
    plans = (WorkloadPlan("burst", 1.0),)
    with pytest.raises(ValueError, match="--prior-surface"):
        CompareConfig(policies=("table:S",), workloads=plans, out_dir=tmp_path, prior_surface=None)
    with pytest.raises(ValueError, match="only table:S"):
        CompareConfig(policies=("fixed:S",), workloads=plans, out_dir=tmp_path, prior_surface=tmp_path)


def test_headline_defaults_to_the_issues_memory_and_surface_tuned_peers(monkeypatch, tmp_path):
    from nightjar_tools.bench import cli, compare

    seen = {}

    def stop(cfg, log):
        seen["cfg"] = cfg
        raise RuntimeError("stop before starting a stack")

    monkeypatch.setattr(compare, "run_comparison", stop)
    assert cli.main(["--headline", "--out", str(tmp_path), "--no-progress"]) == 1
    cfg = seen["cfg"]
    assert cfg.kv_budget_bytes == compare.kv_budget_for_share(cli.HEADLINE_DRAFT_SHARE)
    assert {"table:S", "threshold:S:G", "ema", "heuristic", "nightjar-nooffload"} <= set(cfg.policies)
    assert cfg.prior_surface is not None and cfg.repeats == 3 and cfg.oracle
    # the headline's prompts in bf16 where the CPU has the path (BENCHMARKS.md, "Prompts in bf16 on AMX")
    assert ("--prefill-dtype=bfloat16" in cfg.worker_args) == can_bf16()
    assert cli.main(["--out", str(tmp_path), "--no-progress"]) == 1
    assert seen["cfg"].kv_budget_bytes == compare.kv_budget_for_share(0.6)
    assert "--prefill-dtype=bfloat16" not in seen["cfg"].worker_args
    assert cli.main(["--headline", "--prefill-dtype", "float32", "--out", str(tmp_path), "--no-progress"]) == 1
    assert "--prefill-dtype=bfloat16" not in seen["cfg"].worker_args
    assert cli.main(["--headline", "--worker-arg=--dtype=bfloat16", "--out", str(tmp_path), "--no-progress"]) == 1
    assert "--prefill-dtype=bfloat16" not in seen["cfg"].worker_args  # bf16 prefill is the fp32 engine's


def test_kv_budget_makes_the_draft_the_asked_share():
    from nightjar_tools.bench.compare import draft_weight_bytes, kv_budget_for_share

    draft = draft_weight_bytes()
    assert draft > 1 << 20  # float32 bytes of a real checkpoint, not a header's size
    assert kv_budget_for_share(0.6) == pytest.approx(draft / 0.6, abs=1)
    with pytest.raises(ValueError, match="draft-share"):
        kv_budget_for_share(0)


def test_cli_draft_share_defaults_to_the_shipped_draft(monkeypatch, tmp_path):
    """--draft-share without --draft-model sizes the budget from the default draft (it crashed)."""
    from nightjar_tools.bench import cli, compare

    seen = {}

    def stop(cfg, log):
        seen["budget"] = cfg.kv_budget_bytes
        raise RuntimeError("stop before starting a stack")

    monkeypatch.setattr(compare, "run_comparison", stop)
    assert cli.main(["--draft-share", "0.5", "--out", str(tmp_path), "--no-progress"]) == 1
    assert seen["budget"] == compare.kv_budget_for_share(0.5)


def test_markdown_runs_rows_match_the_header():
    recs = [_rec(0, 0.0, 0.5, 2.5, 21)]
    run = {**report.summarize(LoadResult("x", "burst", 0.0, 3.0, recs)), "policy": "nightjar", "loadavg_1m": 3.2,
           "speed_probe_ms": 11.04}
    table = report.markdown_runs([run]).splitlines()
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1
    assert "| burst | nightjar | 1 | 1/1 |" in table[2] and table[2].endswith("| 3.2 | 11.0 |")


def test_plots_copy_only_the_headline_timelines(tmp_path):
    from nightjar_tools.bench.cli import _plots

    samples = [{"t": 0.5 * i, "offered_rps": 1.0, "tokens_per_s": 5.0} for i in range(4)]
    runs = [_run(p, "burst", 100, 1.0, 0.2) for p in ("fixed:3", "nightjar", "ucb")]
    payload = {"calibration": {"capacity_rps": 2.0}, "runs": runs,
               "samples": {"fixed:3|burst": samples, "nightjar|burst": samples, "ucb|burst": samples, "nightjar|burst|r1": samples}}
    _plots(payload, tmp_path / "out", tmp_path / "docs")
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == \
        ["comparison.png", "timeline_fixed_3_burst.png", "timeline_nightjar_burst.png"]
    assert len(list((tmp_path / "out" / "plots").iterdir())) == 4  # every first-repeat timeline + the bars


def test_merge_turns_result_files_into_repeats():
    from nightjar_tools.bench.cli import merge_payloads

    def payload(tps):
        runs = [{**_run("nightjar", "burst", tps, 1.0, 0.2), "kind": "dynamic"}, {**_run("fixed:3", "burst", 100, 2.0, 0.2), "kind": "dynamic"}]
        return {"calibration": {"capacity_rps": 2.0, "fixed_gamma": 3}, "runs": runs, "samples": {"nightjar|burst": [{"t": tps}]}}

    merged = merge_payloads([payload(130), payload(120)])
    assert sorted(r["repeat"] for r in merged["runs"]) == [0, 0, 1, 1]
    (row,) = [g for g in merged["goals"] if g["goal"] == "throughput vs fixed-γ (dynamic)"]
    assert row["ratios"] == pytest.approx([1.3, 1.2])
    assert merged["samples"]["nightjar|burst"] == [{"t": 130}]  # the first repeat's timeline
    other = payload(120)
    other["calibration"]["capacity_rps"] = 3.0
    with pytest.raises(ValueError, match="--calibration"):
        merge_payloads([payload(130), other])
    # Recalibrated runs pair each repeat's runs at that repeat's own load: they merge, and keep
    # every repeat's capacity under its new number.
    first, second = payload(130), payload(120)
    first["calibration"]["recalibrated"] = {"0": 2.0}
    second["calibration"].update(capacity_rps=3.0, recalibrated={"0": 3.0})
    merged = merge_payloads([first, second])
    assert merged["calibration"]["recalibrated"] == {"0": 2.0, "1": 3.0}
    assert sorted(r["repeat"] for r in merged["runs"]) == [0, 0, 1, 1]
    # A file from before runs kept their trace's demand: rebuilt from its config at each repeat's capacity.
    from nightjar_tools.bench.workload import LengthScale, build

    scale = LengthScale(max_output=32)
    for pl in (first, second):
        pl["config"] = {"workloads": [["burst", 10.0]], "seed": 2, "scale": scale.__dict__}
    merged = merge_payloads([first, second])
    for r in merged["runs"]:
        wl = build("burst", 2.0 if r["repeat"] == 0 else 3.0, 10.0, seed=2, scale=scale)
        assert r["offered_tokens"] == int(wl.output_tokens.sum()) > 0
        assert r["offered_span_s"] == pytest.approx(wl.arrival_s[-1] - wl.arrival_s[0])


def test_recalibrate_scales_each_repeats_loads_to_the_capacity_probed_before_it(tmp_path, monkeypatch):
    from nightjar_tools.bench import compare
    from nightjar_tools.bench.compare import CompareConfig, WorkloadPlan, run_comparison

    probed = iter([3.0, 4.0])
    calibrations, seen = [], []

    async def calibrate(cfg, bank, cal, name, log):
        calibrations.append((name, dict(cal)))
        cal["capacity_rps"] = next(probed)
        cal["capacity_probe"] = {"saturated_tokens_per_s": cal["capacity_rps"] * 20}

    async def one_policy(cmp, cfg, policy, rep, bank, workloads, prompts, log):
        seen.append((rep, policy, [wl.capacity_rps for wl in workloads], len(workloads[0])))

    monkeypatch.setattr(compare, "_calibrate", calibrate)
    monkeypatch.setattr(compare, "_one_policy", one_policy)
    plan = (WorkloadPlan("poisson:1.0", 30.0),)
    cfg = CompareConfig(policies=("fixed:G", "nightjar"), workloads=plan, out_dir=tmp_path, capacity_rps=2.0,
                        fixed_gamma=4, repeats=3, recalibrate=True, progress=False)
    cmp = run_comparison(cfg, log=lambda m: None)
    # γ is the first calibration's, so fixed:G stays the same peer; only the capacity is probed again.
    assert [(name, cal["fixed_gamma"], cal["capacity_rps"]) for name, cal in calibrations] == \
        [("calibration-r1", 4, None), ("calibration-r2", 4, None)]
    assert [(rep, policy, caps) for rep, policy, caps, _ in seen] == \
        [(0, "fixed:4", [2.0]), (0, "nightjar", [2.0]), (1, "nightjar", [3.0]), (1, "fixed:4", [3.0]),
         (2, "fixed:4", [4.0]), (2, "nightjar", [4.0])]
    n = {rep: count for rep, _, _, count in seen}
    assert n[0] < n[1] < n[2]  # a faster machine gets a proportionally larger trace
    assert cmp.calibration["recalibrated"] == {"0": 2.0, "1": 3.0, "2": 4.0}
    assert cmp.calibration["recalibration_probes"] == {"1": {"saturated_tokens_per_s": 60.0}, "2": {"saturated_tokens_per_s": 80.0}}

    seen.clear()
    run_comparison(CompareConfig(policies=("nightjar",), workloads=plan, out_dir=tmp_path, capacity_rps=2.0, fixed_gamma=4,
                                 repeats=2, progress=False), log=lambda m: None)
    assert [caps for _, _, caps, _ in seen] == [[2.0], [2.0]]  # without it, one load for every repeat
    with pytest.raises(ValueError, match="closed-loop"):
        CompareConfig(policies=("nightjar",), workloads=(WorkloadPlan("closed:8", 30.0),), out_dir=tmp_path, recalibrate=True)


def test_resume_keeps_the_finished_stacks_and_runs_the_one_cut_short_again(tmp_path, monkeypatch):
    from nightjar_tools.bench import compare
    from nightjar_tools.bench.compare import CompareConfig, ResumeError, WorkloadPlan, run_comparison

    ran, cut = [], {"at": ("nightjar", 1)}  # the stack that is killed after its first workload

    async def one_policy(cmp, cfg, policy, rep, bank, workloads, prompts, log):
        ran.append((policy, rep))
        for k, plan in enumerate(cfg.workloads):
            if k and (policy, rep) == cut["at"]:
                raise RuntimeError("killed")
            cmp.runs.append({**_run(policy, plan.spec, 100.0 + rep, 1.0, 0.1), "repeat": rep, "kind": "dynamic"})
            cmp.samples[f"{policy}|{plan.spec}" + (f"|r{rep}" if rep else "")] = [{"t": 0.0}]
            report.write_json(cfg.out_dir / "results.json", cmp.payload())

    async def oracle(cmp, cfg, rep, bank, workloads, prompts, log):
        ran.append((report.ORACLE, rep))
        cmp.calibration.setdefault("oracle_tables", {})[str(rep)] = {w.spec: {"8": 2} for w in cfg.workloads}
        cmp.runs += [{**_run(report.ORACLE, w.spec, 99.0, 1.0, 0.1), "repeat": rep, "kind": "dynamic"} for w in cfg.workloads]
        report.write_json(cfg.out_dir / "results.json", cmp.payload())

    monkeypatch.setattr(compare, "_one_policy", one_policy)
    monkeypatch.setattr(compare, "_oracle", oracle)
    plan = (WorkloadPlan("burst", 30.0), WorkloadPlan("ramp", 30.0))
    cfg = CompareConfig(policies=("fixed:G", "nightjar"), workloads=plan, out_dir=tmp_path, capacity_rps=2.0,
                        fixed_gamma=4, repeats=2, oracle=True, progress=False)
    with pytest.raises(ResumeError, match="does not exist"):
        run_comparison(replace(cfg, resume=True), log=lambda m: None)
    with pytest.raises(RuntimeError, match="killed"):
        run_comparison(cfg, log=lambda m: None)
    assert ran == [("fixed:4", 0), ("nightjar", 0), (report.ORACLE, 0), ("nightjar", 1)]  # repeat 2 reverses the order

    ran.clear()
    cut["at"] = None
    logs: list[str] = []
    cmp = run_comparison(replace(cfg, repeats=3, resume=True), log=logs.append)  # and one more repeat
    # the cut stack runs again from its first workload; what finished is not run twice
    assert ran == [("nightjar", 1), ("fixed:4", 1), (report.ORACLE, 1), ("fixed:4", 2), ("nightjar", 2), (report.ORACLE, 2)]
    units = [(r["policy"], r["repeat"], r["workload"]) for r in cmp.runs]
    assert len(units) == len(set(units)) == 3 * 3 * 2  # no run of the cut stack is kept twice
    assert sorted(k for k in cmp.samples if k.startswith("nightjar|")) == ["nightjar|burst", "nightjar|burst|r1",
                                                                          "nightjar|burst|r2", "nightjar|ramp",
                                                                          "nightjar|ramp|r1", "nightjar|ramp|r2"]
    assert any("cut short, run again: nightjar (repeat 2)" in m for m in logs)
    assert report.parse_sample_key(report.sample_key("table:1=4,8=0", "poisson:0.3", 2)) == ("table:1=4,8=0", "poisson:0.3", 2)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 18 and saved["calibration"]["capacity_rps"] == 2.0

    for other in (replace(cfg, workloads=plan[:1]), replace(cfg, capacity_rps=3.0), replace(cfg, seed=1)):
        with pytest.raises(ResumeError, match="other settings"):
            run_comparison(replace(other, resume=True), log=lambda m: None)
    ran.clear()
    run_comparison(replace(cfg, repeats=3, resume=True), log=lambda m: None)
    assert ran == []  # all finished: nothing runs again
    monkeypatch.setattr(compare.paths, "cpu_signature", lambda: "GenuineIntel avx512")  # another kind of machine
    with pytest.raises(ResumeError, match=r"other settings \(cpu\)"):
        run_comparison(replace(cfg, repeats=3, resume=True), log=lambda m: None)

    from nightjar_tools.bench.cli import main

    for argv in (["--resume"], ["--resume", "--out", str(tmp_path / "none"), "--policies", "off", "--workloads", "burst@5",
                                "--capacity-rps", "1", "--fixed-gamma", "0", "--no-progress"]):
        with pytest.raises(SystemExit) as exc:  # a usage error, before any stack starts
            main(argv)
        assert exc.value.code == 2
    assert not (tmp_path / "none").exists()


def test_bench_gives_the_workers_its_models_and_sizes_the_budget_by_that_draft(tmp_path):
    from widen_model import widen

    from nightjar_tools.bench.cli import parser
    from nightjar_tools.bench.compare import CompareConfig, WorkloadPlan, draft_weight_bytes, kv_budget_for_share
    from tests.conftest import ROOT  # noqa: F401  (puts scripts/ on the path)

    draft = widen(paths.DEFAULT_DRAFT, tmp_path / "wide-draft", factor=2)
    assert draft_weight_bytes(draft) > draft_weight_bytes()  # the budget follows the draft given
    assert kv_budget_for_share(0.5, draft) == draft_weight_bytes(draft) * 2
    a = parser().parse_args(["--draft-model", str(draft), "--worker-arg=--max-running=8"])
    assert a.draft_model == draft and a.target_model == paths.DEFAULT_TARGET
    cfg = CompareConfig(policies=("off",), workloads=(WorkloadPlan("burst", 1.0),), out_dir=tmp_path,
                        draft_model=draft, worker_args=("--target", "/elsewhere"), kv_budget_bytes=1 << 20)
    stack = cfg.stack_config("off", tmp_path)
    assert stack.draft_path == draft and stack.target_path == paths.DEFAULT_TARGET
    # the Stack puts worker_args after the models, so an explicit --worker-arg=--target=... still wins
    assert list(stack.worker_args) == ["--target", "/elsewhere", "--kv-budget-bytes", str(1 << 20)]
    # nightjar's prior, as nightjar serve's: auto for the shipped target on CPU, none, or a file
    surface = paths.shipped_surface(paths.DEFAULT_TARGET)
    assert surface is not None
    assert parser().parse_args([]).prior_surface == "auto"
    warm = CompareConfig(policies=("nightjar",), workloads=(WorkloadPlan("burst", 1.0),), out_dir=tmp_path,
                         prior_surface=surface)
    assert warm.stack_config("nightjar", tmp_path).prior_surface == surface
    assert warm.stack_config("off", tmp_path, planner=False).prior_surface is None


def test_odd_repeats_reverse_the_policy_order_so_a_steady_drift_cancels():
    from nightjar_tools.bench.compare import policy_order, speed_probe_ms

    pols = ("off", "fixed:4", "nightjar")
    assert [policy_order(pols, r) for r in range(3)] == [pols, pols[::-1], pols]
    # each policy's mean position over a pair of repeats is the same: a linear drift favours none
    assert len({policy_order(pols, 0).index(p) + policy_order(pols, 1).index(p) for p in pols}) == 1
    assert 0 < speed_probe_ms(rounds=3) < 10_000


# --------------------------------------------------------------------------- closed loop


def test_closed_workload_spec():
    from nightjar_tools.bench.workload import CLOSED_OUTPUT_TOKENS, CLOSED_WARMUP_S

    wl = build("closed:16", 3.0, 30)
    assert wl.clients == 16 and wl.warmup_s == CLOSED_WARMUP_S and wl.duration_s == 30 + CLOSED_WARMUP_S
    assert set(wl.output_tokens.tolist()) == {CLOSED_OUTPUT_TOKENS} and len(wl) >= 16 * 30
    for bad in ("closed:0", "closed:x", "closed:5000"):
        with pytest.raises(ValueError, match="closed"):
            build(bad, 1.0, 10)


async def test_loadgen_closed_loop_keeps_exactly_c_in_flight(scripted_server):
    servicer, target = scripted_server
    servicer.step_s = 0.01
    n = 400
    wl = Workload("closed:3", np.zeros(n), np.full(n, 2), np.full(n, 6), 1.0, 1.0, clients=3, warmup_s=0.3)
    t0 = time.monotonic()
    res = await run_load(wl, [f"p{i} x" for i in range(n)], LoadConfig(target=target, drain_timeout_s=2, progress=False))
    assert time.monotonic() - t0 < 2.5
    sent = [r for r in res.records if r.status != "not_sent"]
    assert servicer.peak == 3  # never more than C in flight, and C reached
    assert 3 * 4 <= len(sent) < n and all(r.ok for r in sent)
    assert max(r.sent_s for r in sent) < 1.0  # no request starts after the run's end
    # each client sends its next request as its last one ends: sends follow completions closely
    ends = sorted(r.end_s for r in sent)
    starts = sorted(r.sent_s for r in sent)[3:]
    assert all(s - e < 0.05 for s, e in zip(starts, ends))
    full, counted = report.summarize(res), report.summarize(res, warmup_s=wl.warmup_s)
    assert counted["sent"] < full["sent"] and counted["makespan_s"] < full["makespan_s"]
    # the steady rate, while all three send: each request is 3 responses of 2 tokens, step_s apart
    steady = report.summarize_workload(res, None, wl)
    assert steady["tokens_per_s"] == steady["steady_tokens_per_s"] > 0.9 * counted["makespan_tokens_per_s"]
    assert report.demand_ceiling(steady) is None  # a closed loop's demand follows its service
    assert steady["tokens_per_s"] <= 1.05 * 3 * 6 / (3 * servicer.step_s)


def test_a_trace_that_asks_for_less_than_the_goal_says_so():
    """Where both policies serve every request, tokens/s is the trace's demand over its span: the
    goal row says no policy could reach the target."""
    from nightjar_tools.bench.workload import build

    wl = build("poisson:0.5", 20.0, 10.0, seed=1)
    span = float(wl.arrival_s[-1] - wl.arrival_s[0])
    offered = int(wl.output_tokens.sum())

    def served(slowdown: float, policy: str) -> dict:  # every request served, the last one late by `slowdown` s
        recs = [_rec(i, float(t), float(t) + 0.1, float(t) + 0.2 + (slowdown if i == len(wl) - 1 else 0.0), int(n))
                for i, (t, n) in enumerate(zip(wl.arrival_s, wl.output_tokens))]
        return {**report.summarize_workload(LoadResult("x", "poisson:0.5", 0.0, span + 5, recs), None, wl), "policy": policy}

    fast, slow = served(0.0, "nightjar"), served(1.0, "fixed:3")
    assert fast["offered_tokens"] == offered and fast["offered_span_s"] == pytest.approx(span)
    assert report.demand_ceiling(fast) == pytest.approx(offered / span)
    assert fast["tokens_per_s"] <= report.demand_ceiling(fast) and slow["tokens_per_s"] < fast["tokens_per_s"]
    (row,) = [r for r in report.goal_rows([fast, slow], {"poisson:0.5": "dynamic"}) if r["goal"].startswith("throughput vs fixed")]
    assert row["met"] is False and row["note"].startswith("unreachable")
    cap = (offered / span) / slow["tokens_per_s"]
    assert f"{cap:.3f}×" in row["note"] and cap < 1.27
    assert "no policy exceeds" in report.markdown_summary([fast, slow])
    fast.pop("offered_span_s")  # a results.json from before the field: no claim either way
    (row,) = [r for r in report.goal_rows([fast, slow], {"poisson:0.5": "dynamic"}) if r["goal"].startswith("throughput vs fixed")]
    assert row["note"] == ""


def test_goal_rows_best_static_takes_the_best_of_each_repeat():
    runs = [_run("nightjar", "closed:16", 100, 1.0, 0.2), _run("off", "closed:16", 90, 1.0, 0.2),
            _run("fixed:2", "closed:16", 104, 1.0, 0.2), _run("table:4=1", "closed:16", 200, 1.0, 0.2),
            {**_run("nightjar", "closed:16", 99, 1.0, 0.2), "repeat": 1}, {**_run("off", "closed:16", 100, 1.0, 0.2), "repeat": 1}]
    (row,) = [r for r in report.goal_rows(runs, {"closed:16": "closed"})]
    assert row["baseline"] == "best-static"  # the table policy is not static: it is not a baseline here
    assert row["ratios"] == pytest.approx([100 / 104, 0.99])
    assert row["ratio"] == pytest.approx((100 / 104 + 0.99) / 2) and row["met"] is True  # median of two, >= 0.97


def test_headline_runs_every_peer_on_every_goal_workload_three_times(tmp_path, monkeypatch):
    from nightjar_tools.bench import cli, compare

    class Captured(Exception):
        pass

    def capture(cfg, log):
        raise Captured(cfg)

    monkeypatch.setattr(compare, "run_comparison", capture)
    with pytest.raises(Captured) as got:
        cli.main(["--headline", "--no-progress", "--out", str(tmp_path)])
    cfg = got.value.args[0]
    assert cfg.repeats == 3 and {"ema", "heuristic", "nightjar", "nightjar-nooffload", "fixed:G", "off"} <= set(cfg.policies)
    kinds = {w.spec.split(":")[0].split("@")[0]: w.duration_s for w in cfg.workloads}
    assert {"burst", "oscillation", "ramp", "azure_conv", "azure_code", "poisson"} <= set(kinds)
    assert all(w.duration_s >= 120 for w in cfg.workloads if w.kind == "dynamic")


def test_comparison_chart_shows_small_differences_with_repeats_and_a_clear_legend(tmp_path):
    """docs/bench/comparison.png's code: ±10% must be readable, repeats give whiskers, and the
    legend must not sit on any bar."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    runs = [_run("fixed:3", "burst", 100, 2.0, 0.2), _run("fixed:3", "burst", 100, 2.0, 0.2),
            _run("nightjar", "burst", 104, 1.9, 0.2), _run("nightjar", "burst", 112, 1.7, 0.2),
            _run("off", "burst", 95, 2.1, 0.2), _run("off", "burst", 93, 2.2, 0.2),
            _run("fixed:3", "poisson:1.5", 50, 5.0, 1.0), _run("nightjar", "poisson:1.5", 54, 4.6, 1.0),
            _run("off", "poisson:1.5", 47, 5.3, 1.0)]
    fig = plots.comparison_figure(runs, "fixed:3", "test")
    try:
        fig.canvas.draw()
        top, bottom = fig.axes
        lo, hi = top.get_ylim()
        assert lo > 0.5 and hi - lo < 0.5, (lo, hi)  # fitted to the data: a 10% difference is visible
        assert lo < 0.93 and hi > 1.12  # ... and every value (whiskers included) is inside
        bars = {(round(p.get_x() + p.get_width() / 2, 3)): p for p in top.patches}
        nightjar_burst = bars[round(0 + 1 * 0.8 / 3, 3)]
        assert nightjar_burst.get_y() == 1.0 and abs(nightjar_burst.get_height() - 0.08) < 1e-9  # mean of 1.04, 1.12
        whiskers = [c for c in top.containers if isinstance(c, ErrorbarContainer)]
        assert whiskers, "repeats must show as error bars"
        segs = [seg for c in whiskers for lc in c.lines[2] for seg in lc.get_segments()]
        assert any(abs(s[0][1] - 1.04) < 1e-9 and abs(s[1][1] - 1.12) < 1e-9 for s in segs)
        # the legend is the figure's, outside both panels
        (legend,) = fig.legends
        renderer = fig.canvas.get_renderer()
        box = legend.get_window_extent(renderer)
        for artist in (*fig.axes, fig._suptitle, *(ax.xaxis for ax in fig.axes)):
            assert not box.overlaps(artist.get_window_extent(renderer)), artist
        assert [t.get_text() for t in legend.get_texts()] == ["fixed:3", "nightjar", "off"]
    finally:
        plt.close(fig)
    path = plots.comparison_bars(runs, tmp_path / "cmp.png", "fixed:3", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparison_chart_pairs_each_repeat_with_the_baselines_run_in_it():
    """As the goals table does: repeats at different loads (--recalibrate) or machine speeds give
    each ratio against the same repeat's baseline, and the bar is their median."""
    import matplotlib.pyplot as plt

    runs = [{**_run("fixed:4", "conv", tps, 2.0, 0.2), "repeat": rep} for rep, tps in enumerate([100, 120, 80])]
    runs += [{**_run("nightjar", "conv", tps, 1.0, 0.2), "repeat": rep} for rep, tps in enumerate([130, 150, 104])]
    ratios = plots._ratios(runs, "fixed:4", "tokens_per_s")
    assert ratios[("nightjar", "conv")] == pytest.approx([1.3, 1.25, 1.3])  # ÷ the mean would give 1.3, 1.5, 1.04
    assert ratios[("fixed:4", "conv")] == pytest.approx([1.0, 1.0, 1.0])
    fig = plots.comparison_figure(runs, "fixed:4", "test")
    try:
        nightjar = max(fig.axes[0].patches, key=lambda p: p.get_x())
        assert nightjar.get_height() == pytest.approx(0.3)  # the median, as the goals report it
        assert "min–max of 3 repeats" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
    fig = plots.comparison_figure(runs + [{**_run("ema", "conv", 120, 1.5, 0.2), "repeat": 0}], "fixed:4", "test")
    try:
        assert "min–max of 1–3 repeats" in fig._suptitle.get_text()  # a peer that ran in fewer repeats
    finally:
        plt.close(fig)


def test_oracle_table_takes_each_buckets_cheapest_gamma_per_token_over_every_policy():
    def run(policy, cells):
        return {"policy": policy, "engine": {"cells": cells}}

    runs = [run("off", {"4|0": [100, 800.0, 400], "64|0": [100, 4000.0, 6400]}),
            run("fixed:3", {"4|3": [100, 1700.0, 1000], "64|3": [100, 15000.0, 12000], "16|3": [5, 10.0, 100]}),
            run("table", {"64|1": [100, 8400.0, 9000]})]
    # bucket 4: γ3 1.7 ms/token < γ0 2.0; bucket 64: γ0 0.625 < γ1 0.93 < γ3 1.25; bucket 16: 5 steps only
    assert report.oracle_table(runs) == {4: 3, 64: 0}
    assert report.oracle_table(runs, min_steps=1) == {4: 3, 16: 3, 64: 0}
    assert report.oracle_table([run("x", {})]) == {}


def _timeline(rates, per_phase=40, dt=1.0):
    """Samples over phases of nominal load: [(nominal_rps, tokens_per_s function of t in phase)]."""
    out, t = [], 0.0
    for rps, tps in rates:
        for i in range(per_phase):
            t += dt
            out.append({"t": t, "nominal_rps": rps, "tokens_per_s": tps(i * dt)})
    return out


def test_learning_delays_time_how_long_the_subject_trails_the_best_static_after_each_change():
    steady = lambda v: (lambda _t: v)  # noqa: E731
    fixed = _timeline([(1.0, steady(100)), (5.0, steady(300)), (1.0, steady(100))])
    off = _timeline([(1.0, steady(80)), (5.0, steady(400)), (1.0, steady(80))])
    # nightjar: at 200 for the first 20 s of the overload phase, then 400; never catches up in phase 3
    nightjar = _timeline([(1.0, steady(100)), (5.0, lambda t: 200 if t < 20 else 400), (1.0, steady(50))])
    delays = report.learning_delays({"nightjar": nightjar, "fixed:3": fixed, "off": off}, baselines=("fixed:3", "off"),
                                    window_s=10.0, horizon_s=60.0)
    assert [d["baseline"] for d in delays] == ["off", "fixed:3"]  # the best of each phase
    first, second = delays
    # the 10 s window is at 400 from t = change + 20 + 10, >= 0.95 × 400 a sample before: 29-30 s
    assert 28 <= first["delay_s"] <= 31
    assert second["delay_s"] is None  # 50 < 0.95 × 100 for the whole phase
    payload = {"runs": [{"workload": "burst", "kind": "dynamic", "policy": p} for p in ("nightjar", "fixed:3", "off")],
               "samples": {"nightjar|burst": nightjar, "fixed:3|burst": fixed, "off|burst": off}}
    (row,) = report.learning_rows(payload)
    assert row["ratio"] == 0.5 and row["met"] is False and "median delay" in row["note"]
    assert "**missed** (median delay" in report.markdown_goals([row])


def test_a_phase_shorter_than_the_window_is_not_judged_a_miss():
    steady = lambda v: (lambda _t: v)  # noqa: E731
    # 40 pieces of 3 s (the oscillation in a 120 s run), then one long phase nightjar catches up in
    pieces = [(1.0 + (i % 2), steady(100)) for i in range(40)] + [(9.0, steady(300))]
    fixed = _timeline(pieces[:40], per_phase=3) + _timeline(pieces[40:], per_phase=40)
    nightjar = _timeline(pieces[:40], per_phase=3) + _timeline([(9.0, steady(290))], per_phase=40)
    for s in nightjar[120:]:
        s["t"] += 120.0
    for s in fixed[120:]:
        s["t"] += 120.0
    delays = report.learning_delays({"nightjar": nightjar, "fixed:3": fixed}, baselines=("fixed:3",), window_s=10.0)
    assert [d["judged"] for d in delays] == [False] * 39 + [True] and delays[-1]["delay_s"] is not None
    payload = {"runs": [{"workload": "oscillation", "kind": "dynamic", "policy": p} for p in ("nightjar", "fixed:3")],
               "samples": {"nightjar|oscillation": nightjar, "fixed:3|oscillation": fixed}}
    (row,) = report.learning_rows(payload)
    assert row["ratio"] == 1.0 and row["met"] is True and "39 phases shorter than the window not judged" in row["note"]
    payload["samples"] = {k: v[:120] for k, v in payload["samples"].items()}  # only the short pieces
    (row,) = report.learning_rows(payload)
    assert row["met"] is None and row["ratio"] is None and row["note"].startswith("not judged")


def test_closed_ab_table_shows_the_same_arm_speed_of_the_two_stacks(tmp_path, capsys):
    # Two stacks at the same γ and batch ran 5-28% apart for minutes (BENCHMARKS.md, the live
    # planner, seventh session): the table's same-arm column shows it beside each ratio.
    import bench_closed_ab

    def row(policy, rnd, tps, cells):
        return {"clients": 48, "round": rnd, "policy": policy, "tokens_per_s": tps, "steps": 100, "gamma_switches": 0,
                "cpu_s": {}, "wall_s": 15.0, "cells": cells}
    rows = []
    for rnd, slow in enumerate((1.0, 1.25)):  # nightjar's stack 25% slower per token in round 1
        rows.append(row("off", rnd, 1000.0, {"64|0": [400, 400 * 40.0, 400 * 48]}))
        rows.append(row("fixed:1", rnd, 900.0, {"64|1": [300, 300 * 60.0, 300 * 80]}))
        rows.append(row("nightjar", rnd, 1000.0 / slow, {"64|0": [380, 380 * 40.0 * slow, 380 * 48],
                                                          "32|1": [20, 20 * 30.0, 20 * 40]}))
    assert bench_closed_ab.same_arm_speed(rows[:3], "off") == pytest.approx(1.0)
    assert bench_closed_ab.same_arm_speed(rows[3:], "off") == pytest.approx(1.25)
    assert bench_closed_ab.same_arm_speed(rows[3:], "fixed:1") is None  # nightjar never ran 64|1
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"args": {"policies": "off,fixed:1", "rounds_per_repeat": 1}, "runs": rows}))
    assert bench_closed_ab.main(["--table-from", str(results)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "1.000, 0.800 (**0.900**) vs `off`" in line and "1.000, 1.250 (**1.125**)" in line


def test_closed_ab_records_every_policy_beside_the_name_replays_read(tmp_path):
    # --record keeps nightjar's steps where the replay tests read them, and each static policy's
    # beside them, so the static runs can be taken apart the same way (BENCHMARKS.md, tenth session).
    import bench_closed_ab

    names = {p: bench_closed_ab.record_path(tmp_path, 48, "round3", p).name for p in ("nightjar", "off", "fixed:1")}
    assert names == {"nightjar": "steps_closed48_round3.json", "off": "steps_closed48_round3_off.json",
                     "fixed:1": "steps_closed48_round3_fixed-1.json"}
    assert bench_closed_ab.record_path(tmp_path, 16, "settle", "nightjar").name == "steps_closed16_settle.json"


async def test_a_held_policy_is_published_by_the_stack_planner_and_lifted_after(redis_url, key_prefix):
    # The one-stack bench runs each static policy through the stack's own planner (keys.planner_hold),
    # and a bench that dies without lifting it lets the planner go back once the key expires.
    from types import SimpleNamespace

    import redis.asyncio as aioredis

    from nightjar.messages import Policy
    from nightjar_tools.bench.compare import HeldByPlanner
    from planner_svc.config import PlannerConfig
    from planner_svc.service import PlannerService

    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_url)
    service = PlannerService(PlannerConfig(redis_url=redis_url, key_prefix=key_prefix, policy="fixed:3",
                                           consumer="p1", read_block_ms=20), r)
    stop = asyncio.Event()
    loop = asyncio.create_task(service.run(stop))
    stack = SimpleNamespace(cfg=SimpleNamespace(key_prefix=key_prefix), redis_url=redis_url)

    async def published() -> Policy:
        return Policy.decode(await r.get(keys.policy))
    try:
        async with HeldByPlanner(stack, "fixed:1", every_s=0.2, expire_s=0.5):
            await asyncio.sleep(1.0)  # past the expiry: the refresh keeps it
            assert (await published()).name == "hold:fixed:1" and (await published()).gamma_by_bucket == (1,) * 7
        assert (await published()).name == "fixed:3" and await r.get(keys.planner_hold) is None
        dying = HeldByPlanner(stack, "off", every_s=60.0, expire_s=0.5)
        await dying.__aenter__()
        assert (await published()).gamma_by_bucket == (0,) * 7
        dying._stopped = True
        dying._task.cancel()
        await dying._redis.aclose()
        await asyncio.sleep(1.0)
        assert (await published()).name == "fixed:3"
        with pytest.raises(RuntimeError, match="did not take the hold"):  # no planner: a clear error
            async with HeldByPlanner(SimpleNamespace(cfg=SimpleNamespace(key_prefix=key_prefix + "x"),
                                                     redis_url=redis_url), "off", timeout_s=0.5):
                pass
    finally:
        stop.set()
        await loop
        await r.aclose()


def test_a_trace_cut_by_max_requests_says_how_much_it_lost():
    whole = build("ramp", 24.8, 120.0, max_requests=5000)
    assert whole.cut == 0 and len(whole) > 2000 and whole.arrival_s[-1] > 110  # the ramp's top is its end
    cut = build("ramp", 24.8, 120.0)  # the default cap: 2000
    assert len(cut) == 2000 and cut.cut == len(whole) - 2000 and cut.arrival_s[-1] < whole.arrival_s[-1]
    from nightjar_tools.bench.cli import parser

    for bad in ("0", "-5", "many"):  # refused by the parser in every mode, --target included
        with pytest.raises(SystemExit):
            parser().parse_args(["--max-requests", bad])
    assert parser().parse_args(["--max-requests", "3000"]).max_requests == 3000


def test_the_fixed_peer_is_the_smallest_gamma_the_probe_cannot_tell_from_the_fastest():
    from nightjar_tools.bench.compare import GAMMA_TIE, pick_gamma

    # the twenty-eighth and thirtieth sessions' batch-1 probes: 3 and 4 within the probe's spread
    assert pick_gamma({0: 78.4, 1: 116.3, 2: 131.6, 3: 146.7, 4: 148.9}) == 3
    assert pick_gamma({0: 78.8, 1: 120.1, 2: 130.8, 3: 145.2, 4: 141.0}) == 3
    assert pick_gamma({0: 78.0, 1: 116.0, 2: 131.0, 3: 140.0, 4: 150.0}) == 4  # 7% apart: a real winner
    assert pick_gamma({0: 100.0, 1: 90.0}) == 0  # speculation that does not pay at batch 1
    assert pick_gamma({0: 100.0, 1: 102.0}, tie=0.0) == 1 and pick_gamma({0: 100.0, 1: 102.0}) == 0
    assert 0 < GAMMA_TIE < 0.1


def test_replay_residency_reads_a_recording_at_a_given_pool_threshold(tmp_path):
    # A minute of a pool 85% used with a queue waiting, at γ = 0 and batch 40 (1 ms per token).
    steps = [msgspec.structs.replace(_step(i, 0, batch=40, emitted=40), unix_ms=80 * i, draft_ms=0.0, verify_ms=40.0,
                                     step_ms=40.0, kv_blocks_used=85, kv_blocks_free=15, waiting=30) for i in range(750)]
    path = tmp_path / "nightjar_burst.json"
    path.write_text(json.dumps(recording(steps, bench_source("nightjar", "burst", 1))))

    def replay(fraction):
        cmd = [sys.executable, str(ROOT / "scripts/replay_residency.py"), str(path), "--kv-full-fraction", fraction]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout

    assert replay("0.9") == "nightjar_burst.json: the draft stays\n"
    out = replay("0.8")
    assert out.startswith("nightjar_burst.json: offloaded at ") and "resident" not in out, out


def test_the_gamma_probe_takes_turns_so_a_machine_that_slows_down_does_not_rank_the_gammas(monkeypatch, tmp_path):
    import asyncio
    from types import SimpleNamespace

    from nightjar_tools.bench import compare
    from nightjar_tools.bench.compare import CompareConfig, WorkloadPlan, probe_gamma
    from nightjar_tools.bench.workload import PromptBank

    speed = {0: 100.0, 1: 150.0, 2: 165.0, 3: 180.0, 4: 195.0}  # batch-1 tokens/s on a steady machine
    published, runs = [], []

    async def publish(stack, gamma, version, table=None, name=""):
        assert not published or version > published[-1][1]  # every policy supersedes the last
        published.append((gamma, version))

    async def run_on_stack(stack, workload, prompts, cfg, label):
        g = published[-1][0]
        slow = 1.0 - 0.025 * len(runs)  # the machine loses 2.5% of its speed per request
        if label.endswith("warm-up"):
            slow *= 0.1  # a first request at a γ pays for whatever its first use costs
        runs.append((g, label))
        tokens = int(workload.output_tokens[0])
        rec = SimpleNamespace(ok=True, completion_tokens=tokens, itl_s=1.0 / (speed[g] * slow))
        return SimpleNamespace(records=[rec]), {"acceptance": 0.7 if g else None, "spec_step_share": float(g > 0)}

    monkeypatch.setattr(compare, "_publish", publish)
    monkeypatch.setattr(compare, "run_on_stack", run_on_stack)
    monkeypatch.setattr(compare, "GAMMA_SWITCH_S", 0.0)
    cfg = CompareConfig(policies=("fixed:G",), workloads=(WorkloadPlan("burst", 1.0),), out_dir=tmp_path, progress=False,
                        gamma_probe_requests=4)
    out = asyncio.run(probe_gamma(SimpleNamespace(), cfg, PromptBank(), gamma_max=6))

    forward, back = [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]
    assert [g for g, _ in runs] == forward + forward + back + forward + back  # γ max is the planner's 4
    assert [label.endswith("warm-up") for _, label in runs] == [True] * 5 + [False] * 20
    assert out["fixed_gamma"] == 4 and not out["notes"]
    # 4 requests per γ in blocks, as before, would have ranked γ = 1 first: it ran while the machine was fast
    blocked = {g: speed[g] * (1.0 - 0.025 * (4 * g + 1.5)) for g in speed}
    assert compare.pick_gamma(blocked) == 1
    probed = {int(g): row["tokens_per_s"] for g, row in out["gamma_probe"].items()}
    # every γ saw about the same slowdown (the rounds' drift cancels in pairs): the ratios are the machine's
    for g in speed:
        assert probed[g] / probed[0] == pytest.approx(speed[g] / speed[0], rel=0.05)
    assert out["gamma_probe"][0]["acceptance"] is None and out["gamma_probe"][3]["acceptance"] == 0.7
    assert published[-1][0] == 0  # the capacity probe after it runs at γ = 0
