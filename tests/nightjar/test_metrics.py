"""nightjar.metrics: known observations show up, with the right names and values, in a real scrape."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nightjar import metrics as m
from nightjar.messages import Policy, StepStats
from nightjar_tools.redis_server import free_port


def _scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module", autouse=True)
def roles() -> None:
    for role in ("gateway", "worker", "planner", "scheduler"):
        m.use(role, "tiny-test")


def M(**labels) -> dict[str, str]:
    """``labels`` plus this process's model_name label."""
    return {"model_name": m.model_name(), **labels}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    if m.served_port() is None:  # another test in this process may already serve the one endpoint
        m.serve(free_port(), addr="127.0.0.1")
    return m.served_port()


def _step(**kw) -> StepStats:
    base = dict(worker_id="w0", step=1, unix_ms=0, batch_size=4, gamma=3, draft_ms=1.0, verify_ms=2.0,
                step_ms=4.0, accepted_per_position=(4, 3, 1), emitted_tokens=12, kv_blocks_used=30,
                kv_blocks_free=70, waiting=2, preempted=1, preempted_tokens=37, draft_residency="resident",
                catchup_tokens=17, catchup_ms=25.0)
    base.update(kw)
    return StepStats(**base)


def test_every_metric_is_prefixed(metrics_port):
    names = {f.name for f in text_string_to_metric_families(_scrape_text(metrics_port))}
    assert names, "empty scrape"
    assert all(n.startswith(("nightjar_", "process_")) for n in names), sorted(
        n for n in names if not n.startswith(("nightjar_", "process_")))
    for expected in ("nightjar_num_requests_running", "nightjar_num_requests_waiting", "nightjar_gateway_requests_queued",
                     "process_cpu_seconds", "process_resident_memory_bytes", "nightjar_kv_cache_usage_perc",
                     "nightjar_time_to_first_token_seconds", "nightjar_inter_token_latency_seconds",
                     "nightjar_e2e_request_latency_seconds", "nightjar_request_queue_time_seconds",
                     "nightjar_prompt_tokens", "nightjar_generation_tokens", "nightjar_request_success",
                     "nightjar_num_preemptions", "nightjar_num_preempted_tokens", "nightjar_spec_decode_num_drafts",
                     "nightjar_spec_decode_num_draft_tokens", "nightjar_spec_decode_num_accepted_tokens",
                     "nightjar_spec_decode_num_accepted_tokens_per_pos", "nightjar_gamma", "nightjar_draft_resident",
                     "nightjar_draft_moves", "nightjar_draft_move_seconds", "nightjar_catchup_seconds"):
        assert expected in names, expected


def test_request_done_over_http(metrics_port):
    before = _samples(_scrape_text(metrics_port))
    m.GATEWAY_QUEUED.set(5)
    m.observe_request_done("stop", prompt_tokens=7, completion_tokens=11, ttft_s=0.03, e2e_s=0.4, queue_s=0.002)
    m.observe_request_done("length", prompt_tokens=3, completion_tokens=16, ttft_s=None, e2e_s=1.2, queue_s=None)
    m.observe_request_done("weird-reason", prompt_tokens=1, completion_tokens=0, ttft_s=None, e2e_s=0.01, queue_s=None)
    m.observe_inter_token(0.004)
    after = _samples(_scrape_text(metrics_port))

    def d(name, **labels):
        return _v(after, name, **M(**labels)) - _v(before, name, **M(**labels))

    assert _v(after, "nightjar_gateway_requests_queued") == 5
    assert d("nightjar_request_success_total", finished_reason="stop") == 1
    assert d("nightjar_request_success_total", finished_reason="length") == 1
    assert d("nightjar_request_success_total", finished_reason="other") == 1  # unknown reasons do not add series
    assert not any(dict(k[1]).get("finished_reason") == "weird-reason" for k in after)
    # one non-empty model name on every series (the first a process gives: another test module in
    # this process may have named it first)
    assert len({dict(k[1]).get("model_name") for k in after if k[0].startswith("nightjar_e2e")} - {""}) == 1
    assert d("nightjar_prompt_tokens_total") == 11
    assert d("nightjar_generation_tokens_total") == 27
    assert d("nightjar_time_to_first_token_seconds_count") == 1
    assert d("nightjar_time_to_first_token_seconds_sum") == pytest.approx(0.03)
    assert d("nightjar_time_to_first_token_seconds_bucket", le="0.04") == 1
    assert d("nightjar_time_to_first_token_seconds_bucket", le="0.02") == 0
    assert d("nightjar_e2e_request_latency_seconds_count") == 3
    assert d("nightjar_e2e_request_latency_seconds_sum") == pytest.approx(1.61)
    assert d("nightjar_request_queue_time_seconds_count") == 1
    assert d("nightjar_inter_token_latency_seconds_bucket", le="0.005") == 1
    assert d("nightjar_inter_token_latency_seconds_bucket", le="0.0025") == 0


def _s(name: str, **labels) -> float | None:
    return m.sample(name, M(**labels))


def test_engine_state_follows_the_snapshot_to_idle():
    """The running gauge comes from the engine's snapshot, so it falls to 0 when the engine goes
    idle; a step's stats (which count the sequences that finished in it) do not set it."""
    m.observe_engine_state(running=3, waiting=2, kv_blocks_free=70, kv_blocks_total=100)
    assert _s("nightjar_num_requests_running") == 3
    assert _s("nightjar_num_requests_waiting") == 2
    assert _s("nightjar_kv_cache_usage_perc") == pytest.approx(0.3)
    m.observe_step(_step(batch_size=1, waiting=0))  # the step in which the last sequence finished
    assert _s("nightjar_num_requests_running") == 3
    m.observe_engine_state(running=0, waiting=0, kv_blocks_free=100, kv_blocks_total=100)
    assert _s("nightjar_num_requests_running") == 0
    assert _s("nightjar_kv_cache_usage_perc") == 0


def test_use_registers_only_the_roles_families():
    from prometheus_client import CollectorRegistry

    with pytest.raises(ValueError, match="role"):
        m.use("frontend")
    for role, families in m.ROLES.items():
        reg = CollectorRegistry()
        for c in families:
            reg.register(c)
        names = {f.name for f in reg.collect()}
        if role == "scheduler":
            assert not names
        if role == "planner":
            assert names == {"nightjar_policy_version"}
        if role == "gateway":
            assert "nightjar_time_to_first_token_seconds" in names and "nightjar_gamma" not in names
        if role == "worker":
            assert "nightjar_gamma" in names and "nightjar_time_to_first_token_seconds" not in names
    m.use("gateway")  # again: idempotent, no duplicate-registration error


def test_step_and_moves_in_registry():
    before = _s("nightjar_spec_decode_num_accepted_tokens_total") or 0.0
    pos1 = _s("nightjar_spec_decode_num_accepted_tokens_per_pos_total", position="1") or 0.0
    drafts = _s("nightjar_spec_decode_num_drafts_total") or 0.0
    draft_tokens = _s("nightjar_spec_decode_num_draft_tokens_total") or 0.0
    preempt = _s("nightjar_num_preemptions_total") or 0.0
    preempted_tokens = _s("nightjar_num_preempted_tokens_total") or 0.0
    catchups = _s("nightjar_catchup_seconds_count") or 0.0

    m.observe_step(_step())
    assert _s("nightjar_gamma") == 3
    assert _s("nightjar_draft_resident") == 1
    assert _s("nightjar_draft_residency", state="resident") == 1
    assert _s("nightjar_draft_residency", state="offloaded") == 0
    assert _s("nightjar_spec_decode_num_accepted_tokens_total") - before == 8
    assert _s("nightjar_spec_decode_num_accepted_tokens_per_pos_total", position="1") - pos1 == 3
    assert _s("nightjar_spec_decode_num_drafts_total") - drafts == 4
    assert _s("nightjar_spec_decode_num_draft_tokens_total") - draft_tokens == 12
    assert _s("nightjar_num_preemptions_total") - preempt == 1
    assert _s("nightjar_num_preempted_tokens_total") - preempted_tokens == 37
    assert _s("nightjar_catchup_seconds_count") - catchups == 1

    # gamma 0, draft offloaded: no drafts counted, residency flips, no catch-up observed
    m.observe_step(_step(gamma=0, accepted_per_position=(), draft_residency="offloaded", catchup_tokens=0,
                         acceptance_alarm=True))
    assert _s("nightjar_gamma") == 0
    assert _s("nightjar_draft_resident") == 0
    assert _s("nightjar_draft_residency", state="offloaded") == 1
    assert _s("nightjar_spec_decode_acceptance_alarm") == 1
    assert _s("nightjar_spec_decode_num_drafts_total") - drafts == 4
    assert _s("nightjar_catchup_seconds_count") - catchups == 1

    moves = _s("nightjar_draft_moves_total", direction="offload")
    m.observe_draft_move("offload", 0.05, 1 << 20)
    assert _s("nightjar_draft_moves_total", direction="offload") - moves == 1
    assert _s("nightjar_draft_move_seconds_count", direction="offload") >= 1
    with pytest.raises(ValueError, match="offload"):
        m.observe_draft_move("sideways", 0.1, 0)

    m.observe_policy(Policy(version=42, unix_ms=0, ttl_s=5, bucket_upper_bounds=(4,), gamma_by_bucket=(2,)))
    assert m.sample("nightjar_policy_version") == 42


def test_position_labels_are_capped():
    m.observe_step(_step(gamma=20, accepted_per_position=tuple([1] * 20)))
    labels = {s.labels["position"] for f in m.REGISTRY.collect()
              if f.name == "nightjar_spec_decode_num_accepted_tokens_per_pos" for s in f.samples}
    assert len(labels) <= m.MAX_POSITION_LABELS + 1
    assert f"{m.MAX_POSITION_LABELS}+" in labels


def test_serve_refuses_bad_port_and_second_port(metrics_port):
    m.serve(0)  # off: no-op
    m.serve(metrics_port, addr="127.0.0.1")  # same port again: no-op
    with pytest.raises(ValueError, match="1-65535"):
        m.serve(70000)
    with pytest.raises(RuntimeError, match="one endpoint"):
        m.serve(free_port())


def test_a_scheduler_process_exports_process_metrics_only():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from nightjar import metrics as m; m.use('scheduler'); "
                          "import sys; sys.stdout.write(m.render().decode())"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    names = {f.name for f in text_string_to_metric_families(out)}
    assert "process_resident_memory_bytes" in names
    assert not [n for n in names if n.startswith("nightjar_")]


def test_worker_labels_its_metrics_with_the_gateways_model_name():
    import worker.__main__ as wmain

    assert wmain.parse_config([]).model_name == Path(wmain.parse_config([]).engine.target_path).name
    assert wmain.parse_config(["--served-model-name", "org/name"]).model_name == "org/name"
