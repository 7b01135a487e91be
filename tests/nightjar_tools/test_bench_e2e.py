"""``nightjar bench`` end to end: a real stack (embedded Redis, gateway, scheduler, planner,
worker with the shipped models), one policy, a short steady load, and every artefact written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nightjar import paths
from nightjar_tools.bench.cli import main

pytestmark = pytest.mark.slow


def test_bench_runs_against_a_real_stack(tmp_path):
    out, plots_dir = tmp_path / "out", tmp_path / "plots"
    # Capacity and γ given, so no calibration stack: one stack start, ~14 s of load; then the
    # hindsight oracle's stack, which can only pick the γ = 2 that fixed:2 measured, and whose
    # table the bench keeps in force past the workers' 10 s policy TTL.
    args = ["--policies", "fixed:G", "--workloads", "poisson:0.5@14", "--capacity-rps", "1.2", "--fixed-gamma", "2",
            "--drain-timeout-s", "40", "--output-scale", "0.3", "--max-output", "24", "--oracle", "--record",
            "--out", str(out), "--plots-dir", str(plots_dir), "--no-progress"]
    rc = main(args)
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    run, oracle = data["runs"]
    assert oracle["policy"] == "oracle" and set(oracle["oracle_table"].values()) == {2}
    assert oracle["ok"] == oracle["sent"] >= 1 and oracle["engine"]["spec_step_share"] >= 0.9  # the published table ran
    assert run["policy"] == "fixed:2" and run["sent"] >= 1
    assert data["config"]["draft_model"].endswith("tiny-draft") and data["config"]["draft_weight_bytes"] > 0
    assert run["ok"] == run["sent"], run["errors"]
    assert run["output_tokens"] > 0 and run["ttft_s"]["mean"] > 0 and run["speed_probe_ms"] > 0
    engine = run["engine"]
    assert engine["steps"] > 0 and engine["emitted_tokens"] >= run["output_tokens"]
    assert engine["spec_step_share"] > 0  # the planner's fixed γ = 2 reached the worker
    recorded = json.loads((out / "steps" / "fixed_2_poisson_0.5.json").read_text())  # --record, replay format
    assert recorded["fields"][:2] == ["batch_size", "gamma"] and len(recorded["rows"]) >= engine["steps"]
    assert {row[1] for row in recorded["rows"] if row[0] > 0} == {2}
    rows = [dict(zip(recorded["fields"], row)) for row in recorded["rows"]]
    assert all(r["step_ms"] >= r["verify_ms"] > 0 for r in rows if r["batch_size"] > 0)  # the step's own wall time
    samples = data["samples"]["fixed:2|poisson:0.5"]
    assert samples and any(s.get("kv_blocks_total") for s in samples)
    assert "| poisson:0.5 | fixed:2 |" in (out / "report.md").read_text()
    assert (plots_dir / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (plots_dir / "timeline_fixed_2_poisson_0.5.png").is_file()

    # --resume with one more repeat: the finished repeat is kept as it was, only the second runs
    assert main([*args, "--repeats", "2", "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["runs"][:2] == data["runs"] and again["calibration"]["capacity_rps"] == 1.2
    assert [(r["policy"], r["repeat"]) for r in again["runs"][2:]] == [("fixed:2", 1), ("oracle", 1)]
    assert again["runs"][2]["ok"] == again["runs"][2]["sent"] >= 1 and "fixed:2|poisson:0.5|r1" in again["samples"]


def test_recalibrate_probes_the_capacity_before_each_repeat_on_a_real_stack(tmp_path):
    """The capacity probe on a real stack (closed loop at γ = 0), once per repeat: each repeat's
    runs carry the capacity their loads were scaled to."""
    out = tmp_path / "out"
    rc = main(["--policies", "fixed:G", "--workloads", "poisson:0.5@6", "--fixed-gamma", "2", "--repeats", "2",
               "--recalibrate", "--drain-timeout-s", "30", "--output-scale", "0.3", "--max-output", "24",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    cal = data["calibration"]
    assert cal["capacity_probe"]["saturated_tokens_per_s"] > 0 and cal["capacity_probe"]["finished"] >= 1
    assert set(cal["recalibrated"]) == {"0", "1"} and cal["recalibrated"]["0"] == cal["capacity_rps"]
    assert all(c > 0 for c in cal["recalibrated"].values()) and cal["recalibration_probes"]["1"]["finished"] >= 1
    by_rep = {r["repeat"]: r for r in data["runs"]}
    assert {rep: r["capacity_rps"] for rep, r in by_rep.items()} == {int(k): c for k, c in cal["recalibrated"].items()}
    assert all(r["policy"] == "fixed:2" and r["ok"] == r["sent"] >= 1 for r in by_rep.values())
    assert "Recalibrated before each repeat" in (out / "report.md").read_text()


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:  # a zombie is as good as gone: it holds no port or memory
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _long_bench(tmp_path):
    """A ``nightjar bench`` process running a 300 s closed loop on the tiny pair, and a dict for
    the test to fill with its stack's processes: whatever of them is alive at the end is killed,
    so that a failing test leaves no stack running."""
    cmd = [sys.executable, "-m", "nightjar_tools.cli", "bench", "--policies", "off", "--workloads", "closed:1@300",
           "--target-model", str(paths.TINY_TARGET), "--draft-model", str(paths.TINY_DRAFT), "--no-progress",
           "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stack: dict[int, str] = {}
    try:
        yield proc, stack
    finally:
        for pid in [proc.pid, *stack]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_sigterm_stops_the_bench_and_the_stack_it_started(tmp_path):
    # Python's default SIGTERM action exits at once: a bench killed that way left its gateway,
    # worker, scheduler, planner and Redis running (BENCHMARKS.md, thirteenth session).
    with _long_bench(tmp_path) as (proc, stack):
        seen = []
        for line in proc.stdout:  # the load starts once the stack is up
            seen.append(line)
            if "workload closed:1" in line:
                break
        assert "workload closed:1" in "".join(seen), "".join(seen)[-2000:]
        stack.update(_children(proc.pid))
        assert any(" worker " in c for c in stack.values()) and any(" gateway " in c for c in stack.values()), stack
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        left = {p: c for p, c in stack.items() if _alive(p)}
        assert not left, left


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_sigterm_while_the_stack_starts_stops_what_it_started(tmp_path):
    # The start runs in a thread that a signal cannot cancel, and a stack that never finished
    # starting is not stopped on the way out: before RunningStack waited for it, the bench exited
    # and the stack came up behind it, orphaned.
    with _long_bench(tmp_path) as (proc, stack):
        deadline = time.monotonic() + 120
        while not any(" gateway " in c for c in stack.values()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the gateway is spawned last, just before the wait for the stack to be ready
            stack.update(_children(proc.pid))
        assert any(" worker " in c for c in stack.values()) and any(" gateway " in c for c in stack.values()), stack
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert "workload closed:1" not in out  # interrupted during the start, as intended
        left = {p: c for p, c in stack.items() if _alive(p)}
        assert not left, left
