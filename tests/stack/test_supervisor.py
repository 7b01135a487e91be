"""`nightjar serve` restarts a service that dies, with backoff, and logs it (issue 21, item 3)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nightjar_client import Client
from nightjar_tools.redis_server import free_port
from nightjar_tools.stack import Service
from nightjar_tools.supervisor import Backoff, Supervisor

ROOT = Path(__file__).resolve().parents[2]


def test_backoff_doubles_to_its_cap():
    b = Backoff(first_s=1.0, max_delay_s=8.0)
    assert [b.delay_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    with pytest.raises(ValueError):
        Backoff(first_s=0.0)


class SleepStack:
    """Real processes (``sleep``) standing in for a stack's services."""

    def __init__(self, tmp_path: Path) -> None:
        self.redis = None
        self.services = [Service("scheduler", ["30"], tmp_path / "scheduler.log")]
        for svc in self.services:
            self.relaunch(svc)

    def relaunch(self, svc: Service) -> None:
        svc.proc = subprocess.Popen(["sleep", *svc.args])


def test_supervisor_restarts_after_the_backoff_and_backs_off_while_it_keeps_dying(tmp_path):
    now = [0.0]
    lines: list[str] = []
    stack = SleepStack(tmp_path)
    sup = Supervisor(stack, Backoff(first_s=1.0, max_delay_s=4.0, stable_s=60.0), log=lines.append, clock=lambda: now[0])
    svc = stack.services[0]
    try:
        delays = []
        for _ in range(3):
            first_pid = svc.proc.pid
            svc.proc.kill()
            svc.proc.wait()
            sup.tick()  # noticed: restart scheduled, not done yet
            assert not svc.alive() and "exited with -9" in lines[-1]
            delays.append(float(lines[-1].split("restarting it in ")[1].split(" s")[0]))
            now[0] += delays[-1] - 0.5
            sup.tick()
            assert not svc.alive()  # the backoff is honoured
            now[0] += 0.5
            sup.tick()
            assert svc.alive() and svc.proc.pid != first_pid and "restarted" in lines[-1]
            now[0] += 1.0  # dies again soon after starting
        assert delays == [1.0, 2.0, 4.0] and sup.restarts == 3
        now[0] += 120.0  # up for longer than stable_s: the next death is a first one again
        svc.proc.kill()
        svc.proc.wait()
        sup.tick()
        assert "restarting it in 1 s" in lines[-1]
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()


def _service_pid(serve_pid: int, name: str) -> int:
    """The pid of ``serve_pid``'s child running service ``name``. Scans every process's parent,
    because /proc/PID/task/*/children may miss a child forked while the parent runs."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == serve_pid and b"nightjar_tools.cli" in argv and argv[argv.index(b"nightjar_tools.cli") + 1] == name.encode():
            return int(stat.parent.name)
    raise LookupError(name)


@pytest.mark.slow
def test_serve_restarts_a_killed_scheduler_and_worker_and_serves_again(tmp_path):
    port = free_port()
    env = {**os.environ, "NIGHTJAR_DEFAULT_PAIR": "tiny", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nightjar_tools.cli", "serve", "--port", str(port), "--no-http",
                             "--policy", "fixed:2", "--worker-threads", "1", "--log-dir", str(tmp_path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen: list[str] = []

    def wait_for(*texts: str, timeout_s: float) -> None:
        """Until each of ``texts`` is in a line logged from now on, in any order: the two services
        die and restart on their own backoff clocks."""
        start, deadline = len(seen), time.monotonic() + timeout_s
        while not all(any(t in line for line in seen[start:]) for t in texts):
            if time.monotonic() > deadline:
                raise AssertionError(f"not all of {texts} within {timeout_s} s:\n" + "".join(seen))
            try:
                seen.append(lines.get(timeout=0.2))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)

    try:
        wait_for("ready on", timeout_s=120)
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
            before = client.generate("The old lighthouse keeper", max_tokens=12, ignore_eos=True)
            killed = {name: _service_pid(proc.pid, name) for name in ("scheduler", "worker")}
            for pid in killed.values():
                os.kill(pid, signal.SIGKILL)
            wait_for("nightjar: scheduler exited", "nightjar: worker exited", "nightjar: scheduler restarted (pid",
                     "nightjar: worker restarted (pid", timeout_s=25)
            for name, old in killed.items():
                try:
                    assert _service_pid(proc.pid, name) != old
                except LookupError:
                    raise AssertionError(f"no {name} process after its restart:\n" + "".join(seen)) from None
            client.wait_ready(60)
            after = client.generate("The old lighthouse keeper", max_tokens=12, ignore_eos=True)
        assert after.token_ids == before.token_ids  # greedy: the restarted stack answers as before
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
