"""Start order does not matter: a worker, the scheduler and the planner started before Redis wait
for it with backoff, saying why, and serve once it is up (they used to exit, or in the worker's
case die after loading its models)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from nightjar import paths
from nightjar.keys import Keys
from nightjar.messages import Job, OutputChunk
from nightjar_tools.redis_server import EmbeddedRedis, free_port
from tests.conftest import pair


def spawn(name: str, args: list[str], log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NIGHTJAR_METRICS_PORT", None)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "nightjar_tools.cli", name, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=str(paths.ROOT))


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_services_started_before_redis_wait_for_it_and_then_serve(tmp_path):
    port = free_port()
    common = ["--redis-url", f"redis://127.0.0.1:{port}/0", "--key-prefix", f"s{uuid.uuid4().hex[:6]}"]
    keys = Keys(common[-1])
    target, draft = pair()
    logs = {n: tmp_path / f"{n}.log" for n in ("worker", "scheduler", "planner")}
    procs = {
        "worker": spawn("worker", ["--target", str(target), "--draft", str(draft), "--threads", "1", *common], logs["worker"]),
        "scheduler": spawn("scheduler", common, logs["scheduler"]),
        "planner": spawn("planner", ["--policy", "fixed:2", *common], logs["planner"]),
    }
    server = None
    try:
        for name, log in logs.items():  # the worker says so once its models are loaded
            wait_until(lambda: "waiting for Redis" in log.read_text() or procs[name].poll() is not None, 120, f"{name} to wait")
        time.sleep(1.5)  # a few retries
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{logs[name].read_text()[-2000:]}"
            text = logs[name].read_text()
            assert f"waiting for Redis at 127.0.0.1:{port}" in text and "ConnectionError" in text, text[-2000:]
        server = EmbeddedRedis(port=port).start()
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: r.smembers(keys.workers) and r.exists(keys.heartbeat(next(iter(r.smembers(keys.workers))).decode())),
                   30, "the worker's heartbeat")
        r.xadd(keys.requests, {b"job": Job("after", (5, 6, 7), {"max_tokens": 4}).encode()})
        final = []

        def finished() -> bool:
            final[:] = [OutputChunk.decode(f[b"c"]) for _, f in r.xrange(keys.output("after"))]
            return bool(final) and final[-1].finish_reason is not None

        wait_until(finished, 60, "the request's final chunk")
        assert final[-1].finish_reason == "length" and final[-1].completion_tokens == 4
        wait_until(lambda: r.get(keys.policy) is not None, 30, "the planner's policy")
        r.close()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if server is not None:
            server.stop()
