"""EngineProcess: the engine's step loop in a child process of its own.

On a GPU a small model's decode step is mostly Python launching kernels, so an engine thread
holds the GIL for most of the step and the worker's asyncio side waits on it (BENCHMARKS.md,
"Pipeline overhead"); vLLM V1 moved its EngineCore into a process for the same reason. The
child runs EngineThread's loop and talks over stdin/stdout in length-prefixed frames of the
records in worker/host/protocol.py, never pickle; it exits when its stdin closes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import subprocess
import sys
import threading
from typing import IO, Any, Callable

from nightjar.messages import Message, decode_any
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.host.protocol import Command, Snapshot, StepResult
from worker.host.thread import EngineThread

log = logging.getLogger("worker")

FRAME_MAX_BYTES = 64 << 20  # a 100k-token prompt is ~0.5 MB; a step's outputs a few KB
_HEADER = struct.Struct(">I")


class Start(Message, tag=True):
    """The first frame to the child: the engine's config (EngineConfig's fields) and log level."""

    config: dict[str, Any]
    log_level: str = "INFO"


class Ready(Message, tag=True):
    snapshot: Snapshot


class Failed(Message, tag=True):
    error: str


ToChild = Start | Command
FromChild = Ready | Failed | StepResult


def write_frame(f: IO[bytes], record: Message) -> None:
    if not isinstance(record, Message):
        raise TypeError(f"{type(record).__name__} cannot cross to the engine process (a callable? send a record)")
    data = record.encode()
    if len(data) > FRAME_MAX_BYTES:
        raise ValueError(f"engine frame of {len(data)} bytes exceeds {FRAME_MAX_BYTES}")
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def read_frame(f: IO[bytes], tp: Any) -> Any | None:
    """The next frame as a record of type ``tp`` (a union of tagged records), or None at end of stream."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    if n > FRAME_MAX_BYTES:
        raise ValueError(f"engine frame of {n} bytes exceeds {FRAME_MAX_BYTES}")
    data = f.read(n)
    if len(data) < n:
        return None
    return decode_any(tp, data, FRAME_MAX_BYTES)


# ---------------------------------------------------------------------------- parent side


class EngineProcess:
    """Starts ``python -m worker.host.process`` with ``engine_config`` and relays its frames."""

    def __init__(self, engine_config: EngineConfig, deliver: Callable[[StepResult], None], log_level: str = "INFO") -> None:
        self._start_frame = Start(dataclasses.asdict(engine_config), log_level)
        self._deliver = deliver
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._stopping = False
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.snapshot = Snapshot()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        # stderr is inherited: the child's log lines land in the worker's own log
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.host.process"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, bufsize=0)
        write_frame(self._proc.stdin, self._start_frame)
        self._reader = threading.Thread(target=self._read, name="engine-proc-reader", daemon=True)
        self._reader.start()

    def submit(self, command: Command) -> None:
        with self._write_lock:
            try:
                write_frame(self._proc.stdin, command)
            except (BrokenPipeError, ValueError, OSError) as exc:  # the child is gone: _read reports it
                log.debug("engine process: command not sent (%s)", exc)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._proc is None:
            return
        with self._write_lock:
            try:
                self._proc.stdin.close()  # the child's signal to finish its step and leave
            except OSError:
                pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine process did not exit in %.0f s; killing it", timeout_s)
            self._proc.kill()
            self._proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)

    def _read(self) -> None:
        out = self._proc.stdout
        try:
            while (frame := read_frame(out, FromChild)) is not None:
                if isinstance(frame, StepResult):
                    self._deliver(frame)
                elif isinstance(frame, Ready):
                    self.snapshot = frame.snapshot
                    self.ready.set()
                elif isinstance(frame, Failed):
                    self.error = RuntimeError(frame.error)
                    self.ready.set()
                    self._deliver(StepResult(snapshot=Snapshot()))  # wake the service so it notices
                    return
        except Exception as exc:  # a torn frame: treat as the child's death
            log.error("engine process: bad frame (%s)", exc)
        code = self._proc.wait()
        if not self._stopping and self.error is None:
            self.error = RuntimeError(f"the engine process exited with code {code}")
        self.ready.set()
        self._deliver(StepResult(snapshot=Snapshot()))


# ---------------------------------------------------------------------------- child side


def child_main() -> int:
    rfile, wfile = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not tear a frame
    start = read_frame(rfile, ToChild)
    if not isinstance(start, Start):
        return 2
    logging.basicConfig(level=start.log_level, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    lock = threading.Lock()

    def send(frame: Message) -> None:
        with lock:
            try:
                write_frame(wfile, frame)
            except (BrokenPipeError, OSError):
                pass  # the parent is gone; the reader below sees EOF and stops the engine

    def deliver(result: StepResult) -> None:
        if engine.error is not None:
            send(Failed(f"{type(engine.error).__name__}: {engine.error}"))
        else:
            send(result)

    engine = EngineThread(lambda: Engine(EngineConfig(**start.config)), deliver)
    engine.start()
    engine.ready.wait()
    if engine.error is not None:
        send(Failed(f"{type(engine.error).__name__}: {engine.error}"))
        return 1
    send(Ready(engine.snapshot))
    try:
        while (frame := read_frame(rfile, Command)) is not None:
            engine.submit(frame)
    except Exception as exc:
        log.error("engine process: bad command frame (%s); stopping", exc)
    engine.stop()
    return 0


if __name__ == "__main__":
    code = child_main()
    sys.stderr.flush()
    os._exit(code)  # the engine thread is a daemon; do not wait on torch's atexit work
