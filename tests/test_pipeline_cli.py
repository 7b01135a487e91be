"""`nightjar serve` / `nightjar demo` / each service's own command line."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nightjar.serve import add_stack_args, stack_config

ROOT = Path(__file__).resolve().parents[1]


def test_serve_flags_build_a_validated_config(tmp_path):
    p = argparse.ArgumentParser()
    add_stack_args(p, port=50051)
    a = p.parse_args(["--workers", "3", "--policy", "fixed:2", "--no-draft", "--redis-url", "redis://h:1/0"])
    cfg = stack_config(a, p, log_dir=tmp_path)
    assert (cfg.workers, cfg.draft_path, cfg.redis_url, cfg.log_dir) == (3, None, "redis://h:1/0", tmp_path)
    assert cfg.default_gamma == 0  # no draft: never speculate
    a = p.parse_args(["--policy", "fixed:2"])
    assert stack_config(a, p).default_gamma == 2  # the workers' fallback is the fixed policy's γ
    with pytest.raises(SystemExit):  # argparse error naming the flag
        stack_config(p.parse_args(["--workers", "0"]), p)


@pytest.mark.parametrize("service, argv, field, value", [
    ("gateway.__main__", ["--port", "0", "--max-queued", "7", "--auth-token", "t"], "max_queued", 7),
    ("scheduler_svc.__main__", ["--max-deliveries", "9"], "max_deliveries", 9),
    ("worker.__main__", ["--no-draft", "--max-running", "8"], "draft_path", None),
])
def test_each_service_parses_its_flags(service, argv, field, value, monkeypatch):
    import importlib

    monkeypatch.setenv("NIGHTJAR_REDIS_URL", "redis://envhost:6390/0")
    cfg = importlib.import_module(service).parse_config(argv)
    assert getattr(cfg, field) == value
    assert cfg.redis_url == "redis://envhost:6390/0"  # the environment supplies the default


def test_bad_flags_say_how_to_fix_them(capsys):
    from gateway.__main__ import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--redis-url", "http://x"])
    assert "redis://" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_streams_a_completion_and_stops(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nightjar.cli", "demo", "--max-tokens", "8", "--prompt", "import os\n"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("import os\n")
    assert re.search(r"\d+ prompt \+ [1-8] completion tokens, finish (length|stop); TTFT", out.stdout), out.stdout
    assert "nightjar demo: stopped" in out.stderr


def test_serve_gives_every_service_its_own_metrics_port(tmp_path, monkeypatch):
    from nightjar.stack import metrics_port_of

    monkeypatch.setenv("NIGHTJAR_METRICS_PORT", "9100")
    p = argparse.ArgumentParser()
    add_stack_args(p, port=50051)
    cfg = stack_config(p.parse_args(["--workers", "2"]), p, log_dir=tmp_path)
    assert cfg.metrics_port == 9100  # the environment's port is the base
    ports = [metrics_port_of(9100, "gateway"), metrics_port_of(9100, "scheduler"), metrics_port_of(9100, "planner"),
             metrics_port_of(9100, "worker", 0), metrics_port_of(9100, "worker", 1)]
    assert ports == [9100, 9101, 9102, 9103, 9104]
    with pytest.raises(SystemExit):  # no room above the base for every service
        stack_config(p.parse_args(["--metrics-port", "65534"]), p)
