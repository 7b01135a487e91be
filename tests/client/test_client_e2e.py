"""End to end against a real stack (`nightjar_tools.stack.Stack`: Redis, gateway, scheduler, planner, worker).

The SDK (sync + asyncio), `nightjar generate`, the docs' examples, `nightjar queue` and the
Prometheus endpoints, on the shipped models, over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nightjar import paths
from nightjar_client import AsyncClient, Client, InvalidArgument, RetryPolicy
from nightjar_tools.redis_server import free_port

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Roses are red,"]


@pytest.fixture(scope="module")
def stack():
    from nightjar_tools.stack import Stack, StackConfig

    if not (paths.DEFAULT_TARGET / "config.json").is_file():
        pytest.fail(f"the shipped target model is missing at {paths.DEFAULT_TARGET}")
    from nightjar_tools.stack import metrics_port_of

    base = free_port_run(4)  # one /metrics port per service: gateway, scheduler, planner, worker
    # The environment's port would be the same for every service; the stack must override it.
    os.environ["NIGHTJAR_METRICS_PORT"] = str(free_port())
    try:
        cfg = StackConfig(port=0, workers=1, worker_threads=1, io_nice=5, metrics_port=base)
        with Stack(cfg) as s:
            s.metrics = {name: f"http://127.0.0.1:{metrics_port_of(base, name)}/metrics"
                         for name in ("gateway", "scheduler", "planner", "worker")}
            yield s
    finally:
        del os.environ["NIGHTJAR_METRICS_PORT"]


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    import socket

    for _ in range(100):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_io_services_run_nicer_than_the_worker(stack):
    """io_nice: every service but the worker, and the embedded Redis, starts that much nicer."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    procs = [(svc.name, svc.proc.pid) for svc in stack.services] + [("redis", stack.redis.proc.pid)]
    assert {name for name, _ in procs} >= {"worker", "gateway", "scheduler", "redis"}
    for name, pid in procs:
        assert os.getpriority(os.PRIO_PROCESS, pid) == (base if name == "worker" else min(19, base + 5)), name


def test_generate_and_stream_agree(stack):
    with Client(stack.address, timeout_s=120) as c:
        a = c.generate(PROMPTS[0], max_tokens=12)
        b = c.generate(PROMPTS[0], max_tokens=12)
        assert a.text == b.text and a.token_ids == b.token_ids  # greedy is deterministic
        assert a.finish_reason in ("stop", "length") and 0 < len(a.token_ids) <= 12
        assert a.usage.completion_tokens == len(a.token_ids) and a.usage.prompt_tokens > 0
        assert 0 < a.timings.ttft_ms <= a.timings.e2e_ms
        deltas = list(c.stream(PROMPTS[0], max_tokens=12))
        assert "".join(d.text for d in deltas) == a.text
        assert tuple(t for d in deltas for t in d.token_ids) == a.token_ids
        assert deltas[-1].finish_reason == a.finish_reason and deltas[-1].usage == a.usage


def test_model_info_and_invalid_argument(stack):
    with Client(stack.address, timeout_s=60, retry=RetryPolicy(max_attempts=5, initial_backoff_s=1.0)) as c:
        info = c.model_info()
        assert info.model == paths.DEFAULT_TARGET.name and info.max_tokens_limit > 0
        t0 = time.monotonic()
        with pytest.raises(InvalidArgument, match="temperature"):
            c.generate("hi", temperature=7.5)
        assert time.monotonic() - t0 < 1.0  # not retried (a retry would have slept >= 0.5 s)


async def test_async_concurrent(stack):
    async with AsyncClient(stack.address, timeout_s=120) as c:
        outs = await asyncio.gather(*(c.generate(p, max_tokens=8) for p in PROMPTS))
    with Client(stack.address, timeout_s=120) as s:
        for prompt, out in zip(PROMPTS, outs):
            assert out.text == s.generate(prompt, max_tokens=8).text  # batching does not change greedy output


def test_cli_generate(stack):
    env = {**os.environ, "NIGHTJAR_TARGET": stack.address}
    with Client(stack.address, timeout_s=120) as c:
        expected = c.generate(PROMPTS[1], max_tokens=10)
    proc = subprocess.run([sys.executable, "-m", "nightjar", "generate", PROMPTS[1], "--max-tokens", "10", "--json"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["text"] == expected.text and tuple(doc["token_ids"]) == expected.token_ids
    proc = subprocess.run([sys.executable, "-m", "nightjar", "generate", PROMPTS[1], "--max-tokens", "10", "--stream"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == expected.text + "\n"
    proc = subprocess.run([sys.executable, "-m", "nightjar", "generate", "x", "--temperature", "9"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "INVALID_ARGUMENT" in proc.stderr


def test_docs_examples_on_the_real_stack(stack, monkeypatch, capsys):
    from tests.client.conftest import python_examples, run_example

    monkeypatch.setenv("NIGHTJAR_TARGET", stack.address)
    monkeypatch.delenv("NIGHTJAR_TOKEN", raising=False)
    for code in python_examples():
        run_example(code)
    assert capsys.readouterr().out


def test_metrics_after_known_traffic(stack):
    before = scrape(stack.metrics["gateway"])
    n, max_tokens = 5, 6
    completions = []
    with Client(stack.address, timeout_s=120) as c:
        for i in range(n):
            completions.append(c.generate(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True))
    after = scrape(stack.metrics["gateway"])

    def d(name: str) -> float:
        return total(after, name) - total(before, name)

    assert d("nightjar_request_success_total") == n
    assert d("nightjar_generation_tokens_total") == sum(c.usage.completion_tokens for c in completions) == n * max_tokens
    assert d("nightjar_prompt_tokens_total") == sum(c.usage.prompt_tokens for c in completions)
    assert d("nightjar_time_to_first_token_seconds_count") == n
    assert d("nightjar_e2e_request_latency_seconds_count") == n
    assert d("nightjar_inter_token_latency_seconds_count") >= 1
    reasons = {dict(k[1])["finished_reason"]: v - before.get(k, 0.0) for k, v in after.items()
               if k[0] == "nightjar_request_success_total"}
    assert reasons["length"] == n
    # The scheduler's lease table was up: every job went straight into the worker's inbox.
    assert after[("nightjar_dispatches_total", (("path", "direct"),))] - before.get(
        ("nightjar_dispatches_total", (("path", "direct"),)), 0.0) == n

    # Every service of the stack serves its own endpoint (one port each, not the env's one),
    # with its own families only, and process_* for each.
    families = {name: {n for n, _ in scrape(stack.metrics[name])} for name in ("scheduler", "planner", "gateway")}
    for name, names in families.items():
        assert "process_resident_memory_bytes" in names, name
    assert not any(n.startswith("nightjar_") for n in families["scheduler"])
    assert "nightjar_policy_version" in families["planner"] and "nightjar_gamma" not in families["planner"]
    assert "nightjar_gamma" not in families["gateway"] and "nightjar_num_requests_running" not in families["gateway"]
    assert "nightjar_gateway_requests_queued" in families["gateway"]
    model = (("model_name", paths.DEFAULT_TARGET.name),)
    assert after[("nightjar_e2e_request_latency_seconds_count", model)] >= n
    worker = scrape(stack.metrics["worker"])
    assert ("nightjar_gamma", model) in worker
    assert worker[("nightjar_kv_cache_usage_perc", model)] >= 0.0
    assert "nightjar_time_to_first_token_seconds_count" not in {k for k, _ in worker}
    # Idle again: the running gauge falls back to 0 (it used to keep the last batch's size).
    deadline = time.monotonic() + 10
    while worker[("nightjar_num_requests_running", model)] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        worker = scrape(stack.metrics["worker"])
    assert worker[("nightjar_num_requests_running", model)] == 0
    assert worker[("nightjar_num_requests_waiting", model)] == 0
    assert total(worker, "nightjar_step_seconds_count") > 0
    assert total(worker, "nightjar_spec_decode_num_accepted_tokens_total") <= total(
        worker, "nightjar_spec_decode_num_draft_tokens_total")


def test_queue_tool_sees_the_live_stack(stack):
    from nightjar_tools.queue_tool import main as queue_main

    out = io.StringIO()
    assert queue_main(["workers", "--json", "--redis-url", stack.redis_url, "--prefix", stack.cfg.key_prefix], out=out) == 0
    doc = json.loads(out.getvalue())
    assert doc["alive"] == 1
    w = doc["workers"][0]
    assert w["model"] == paths.DEFAULT_TARGET.name and w["error"] is None and w["heartbeat_age_s"] < 10
    out = io.StringIO()
    assert queue_main(["ls", "--json", "--redis-url", stack.redis_url, "--prefix", stack.cfg.key_prefix], out=out) == 0
    assert json.loads(out.getvalue())["waiting"] == 0  # idle stack: nothing queued
    deadline = time.monotonic() + 30  # the planner publishes its first policy soon after it starts
    while True:
        out = io.StringIO()
        assert queue_main(["policy", "--json", "--redis-url", stack.redis_url, "--prefix", stack.cfg.key_prefix],
                          out=out) == 0
        policy = json.loads(out.getvalue())
        if policy["policy"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert policy["error"] is None and policy["policy"]["version"] >= 0 and policy["policy"]["buckets"]
    out = io.StringIO()
    assert queue_main(["stats", "--json", "--redis-url", stack.redis_url, "--prefix", stack.cfg.key_prefix], out=out) == 0
    stats = json.loads(out.getvalue())
    assert stats["steps"] > 0 and stats["errors"] == []  # the worker's records decode
