"""`nightjar serve` / `nightjar demo` / each service's own command line."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nightjar_tools.serve import add_stack_args, stack_config

ROOT = Path(__file__).resolve().parents[2]


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
    assert stack_config(p.parse_args(["--dtype", "bfloat16"]), p).worker_args == ("--device", "cpu", "--dtype", "bfloat16")
    for bad in (["--device", "tpu"], ["--dtype", "int8"], ["--dtype", "bfloat16", "--prefill-dtype", "bfloat16"]):
        with pytest.raises(SystemExit):
            stack_config(p.parse_args(bad), p)
    from worker.engine.linear import can_bf16

    if can_bf16():
        assert stack_config(p.parse_args(["--prefill-dtype", "bfloat16"]), p).worker_args[-2:] == ("--prefill-dtype", "bfloat16")
    import torch

    if not torch.cuda.is_available():  # said before any service starts, not from a worker's log
        with pytest.raises(SystemExit):
            stack_config(p.parse_args(["--device", "cuda"]), p)


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
flags\t\t: fpu sse2 {flags}

processor\t: 1
vendor_id\t: SomeoneElse
flags\t\t: fpu
"""


@pytest.mark.parametrize("vendor, flags, want", [
    ("AuthenticAMD", "avx avx2 avx512f avx512_bf16", "AuthenticAMD avx512"),
    ("AuthenticAMD", "avx avx2 fma", "AuthenticAMD avx2"),
    ("GenuineIntel", "avx avx2 avx512f avx512vl", "GenuineIntel avx512"),
    ("GenuineIntel", "sse4_2", "GenuineIntel"),
])
def test_cpu_signature_is_the_first_cpus_vendor_and_widest_vector_unit(vendor, flags, want):
    from nightjar import paths

    assert paths.cpu_signature(CPUINFO.format(vendor=vendor, flags=flags)) == want
    assert paths.cpu_signature("") == ""


def test_cpu_l3_is_read_from_sysfs(tmp_path):
    from nightjar import paths

    for index, (level, size) in enumerate([("1", "48K"), ("2", "2048K"), ("3", "491520K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert paths.cpu_l3_kib(tmp_path) == 491520
    (tmp_path / "index2" / "size").write_text("32M\n")
    (tmp_path / "index2" / "level").write_text("3\n")
    assert paths.cpu_l3_kib(tmp_path) == 32768  # the first L3 listed
    assert paths.cpu_l3_kib(tmp_path / "missing") is None


def test_the_default_prior_is_the_surface_measured_on_this_kind_of_cpu():
    """Each serve-pair surface names the CPU it was measured on and its L3; auto picks the one that
    matches (of one signature, the nearest L3), and the pair's first surface where none does."""
    from nightjar import paths

    surfaces = sorted(paths.COST_SURFACES.glob("cpu_serve*.json"))
    by_cpu = {(d["cpu"], d["l3_kib"]): p for p in surfaces for d in [json.loads(p.read_text())]}
    assert len(by_cpu) == len(surfaces) >= 4, "two surfaces claim the same CPU"
    for (cpu, l3), path in by_cpu.items():
        assert paths.shipped_surface(paths.SERVE_TARGET, cpu=cpu, l3_kib=l3) == path
    # Two Xeons share a signature (260 and 480 MiB of L3): a third gets the nearer one's surface.
    xeons = sorted((l3, p) for (cpu, l3), p in by_cpu.items() if cpu == "GenuineIntel avx512")
    assert [l3 for l3, _ in xeons] == [266240, 491520]
    assert paths.shipped_surface(paths.SERVE_TARGET, cpu="GenuineIntel avx512", l3_kib=300 << 10) == xeons[0][1]
    assert paths.shipped_surface(paths.SERVE_TARGET, cpu="GenuineIntel avx512", l3_kib=400 << 10) == xeons[1][1]
    first = paths.COST_SURFACES / "cpu_serve.json"
    assert paths.shipped_surface(paths.SERVE_TARGET, cpu="SomeoneElse neon", l3_kib=266240) == first
    assert paths.shipped_surface(paths.SERVE_TARGET, cpu="") == first
    assert paths.shipped_surface(paths.TINY_TARGET, cpu="AuthenticAMD avx512") == paths.COST_SURFACES / "cpu_tiny.json"
    assert paths.shipped_surface(paths.SERVE_TARGET) in surfaces  # this machine, whatever it is
    # a planner does not know the models; it is told the pair
    assert paths.cost_surface("auto:serve") == paths.shipped_surface(paths.SERVE_TARGET)
    assert paths.cost_surface("auto:tiny") == paths.COST_SURFACES / "cpu_tiny.json"
    with pytest.raises(ValueError, match="auto:PAIR"):
        paths.cost_surface("auto:huge")


def test_the_planner_starts_from_the_surface_shipped_for_the_model_on_cpu(tmp_path):
    """--prior-surface auto (the default): the shipped pair on CPU in float32 gets its own surface,
    anything else learns from nothing; none turns it off; a missing file is refused up front."""
    from nightjar import paths
    from nightjar_tools.stack import Stack

    p = argparse.ArgumentParser()
    add_stack_args(p, port=50051)
    cfg = stack_config(p.parse_args([]), p)
    assert cfg.prior_surface == paths.shipped_surface(paths.DEFAULT_TARGET) and cfg.prior_surface.is_file()
    args = Stack(cfg)._planner_args()
    assert args[args.index("--prior-surface") + 1] == str(cfg.prior_surface)
    assert stack_config(p.parse_args(["--dtype", "bfloat16"]), p).prior_surface is None  # measured in float32
    assert stack_config(p.parse_args(["--prior-surface", "none"]), p).prior_surface is None
    assert "--prior-surface" not in Stack(stack_config(p.parse_args(["--prior-surface", "none"]), p))._planner_args()
    assert paths.shipped_surface(paths.SERVE_TARGET, "cuda") is None and paths.shipped_surface(tmp_path) is None
    with pytest.raises(SystemExit):
        stack_config(p.parse_args(["--prior-surface", str(tmp_path / "missing.json")]), p)


@pytest.mark.parametrize("service, argv, field, value", [
    ("gateway.__main__", ["--port", "0", "--max-queued", "7", "--auth-token", "t"], "max_queued", 7),
    ("scheduler_svc.__main__", ["--max-deliveries", "9"], "max_deliveries", 9),
    ("worker.__main__", ["--no-draft", "--max-running", "8"], "engine.draft_path", None),
    ("worker.__main__", ["--no-draft", "--max-running", "8"], "engine.max_running", 8),
    ("worker.__main__", ["--no-draft"], "engine.prefill_dtype", "float32"),
])
def test_each_service_parses_its_flags(service, argv, field, value, monkeypatch):
    import importlib
    from operator import attrgetter

    monkeypatch.setenv("NIGHTJAR_REDIS_URL", "redis://envhost:6390/0")
    cfg = importlib.import_module(service).parse_config(argv)
    assert attrgetter(field)(cfg) == value
    assert cfg.redis_url == "redis://envhost:6390/0"  # the environment supplies the default


def test_bad_flags_say_how_to_fix_them(capsys):
    from gateway.__main__ import parse_config
    from worker.__main__ import parse_config as worker_config

    with pytest.raises(SystemExit):
        parse_config(["--redis-url", "http://x"])
    assert "redis://" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bf16 prefill is the float32 CPU engine's
        worker_config(["--dtype", "bfloat16", "--prefill-dtype", "bfloat16"])
    assert "prefill_dtype" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_streams_a_completion_and_stops(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nightjar_tools.cli", "demo", "--max-tokens", "8", "--prompt", "import os\n"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("import os\n")
    assert re.search(r"\d+ prompt \+ [1-8] completion tokens, finish (length|stop); TTFT", out.stdout), out.stdout
    assert "nightjar demo: stopped" in out.stderr


@pytest.mark.slow
def test_the_default_demo_on_the_serving_pair_writes_more_than_a_repeated_token():
    from nightjar_tools.demo import DEFAULT_PROMPT

    env = {**os.environ, "NIGHTJAR_DEFAULT_PAIR": "serve"}
    out = subprocess.run([sys.executable, "-m", "nightjar_tools.cli", "demo", "--max-tokens", "48"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(DEFAULT_PROMPT) and "[serve-target (draft serve-draft)" in out.stdout
    completion = out.stdout[len(DEFAULT_PROMPT):].split("\n\n[serve-target")[0]
    # The first trained weights printed `"a"-1.0.0.0.0…` here: one word.
    assert len(set(completion.split())) >= 6, completion


def test_serve_gives_every_service_its_own_metrics_port(tmp_path, monkeypatch):
    from nightjar_tools.stack import metrics_port_of

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


def test_a_service_rss_counts_its_child_processes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from nightjar_tools.stack import Service

    child = "b = bytearray(200 << 20); import time; time.sleep(60)"  # 200 MiB, zero-filled: resident
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    svc = Service("worker", [], tmp_path / "log", proc)
    try:
        own = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            own = int(next(x for x in open(f"/proc/{proc.pid}/status") if x.startswith("VmRSS:")).split()[1]) * 1024
            if svc.rss_bytes() - own > 190 << 20:
                break
            time.sleep(0.1)
        assert svc.rss_bytes() - own > 190 << 20  # the child's 200 MiB counted with the service
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
