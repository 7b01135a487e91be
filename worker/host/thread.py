"""The engine's own thread: the only code that touches Engine state.

The worker service talks to it through two queues: commands in (a thread-safe queue.Queue)
and one StepResult out per step (handed to the event loop with call_soon_threadsafe). Each
StepResult carries a snapshot of the engine's counters, so the asyncio side never reads the
engine directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.host.policy_view import PolicyView
from worker.host.protocol import Abort, Add, Command, FollowPolicy, SetResidency, Snapshot, StepResult, UpdatePolicy

log = logging.getLogger("worker")


class EngineThread:
    """Runs ``engine_factory()`` and then the step loop on a dedicated daemon thread."""

    IDLE_WAIT_S = 0.25  # idle: wake this often to post a fresh snapshot for heartbeats

    def __init__(self, engine_factory: Callable[[], Any], deliver: Callable[[StepResult], None]) -> None:
        self._factory = engine_factory
        self._deliver = deliver  # thread-safe: wraps loop.call_soon_threadsafe
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.snapshot = Snapshot()  # written once before ``ready``; later snapshots travel in StepResults
        self._view: PolicyView | None = None  # the worker's only PolicyView, after FollowPolicy
        self._residency: str | None = None  # the view's last answer, handed to the engine

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)  # wake an idle wait
        self._thread.join(timeout_s)

    def _main(self) -> None:
        try:
            engine = self._factory()
            self.snapshot = _snapshot(engine, 0, 0, None)
        except BaseException as exc:  # reported to the service, which exits with the message
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop(engine)
        except BaseException as exc:
            log.exception("engine thread died")
            self.error = exc
            self._deliver(StepResult(snapshot=Snapshot()))  # wake the service so it notices

    def _loop(self, engine) -> None:
        gamma, steps = 0, 0
        last_snapshot = None
        while not self._stop.is_set():
            rejected: list[tuple[str, str]] = []
            busy = engine.has_unfinished()
            self._apply(engine, self._next_commands(block=not busy), rejected)
            self._follow_residency(engine)  # a policy past its TTL turns "resident" with no command
            outputs, stats = [], None
            if engine.has_unfinished():
                outputs = engine.step()
                steps += 1
                stats = engine.last_stats
                if stats is not None:
                    gamma = stats.gamma
            snap = _snapshot(engine, gamma, steps, self._view)
            if outputs or rejected or stats is not None or snap != last_snapshot:
                self._deliver(StepResult(outputs=outputs, stats=stats, rejected=rejected, snapshot=snap))
                last_snapshot = snap

    def _next_commands(self, block: bool) -> list:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=self.IDLE_WAIT_S))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _apply(self, engine, commands: list, rejected: list[tuple[str, str]]) -> None:
        from worker.engine.engine import EngineRequest

        for cmd in commands:
            if isinstance(cmd, Add):
                try:
                    engine.add_request(EngineRequest(cmd.request_id, cmd.prompt_token_ids, cmd.params))
                except ValueError as exc:
                    rejected.append((cmd.request_id, str(exc)))
            elif isinstance(cmd, Abort):
                try:
                    engine.abort(cmd.request_id)
                except (KeyError, ValueError):
                    pass  # already finished: nothing to free
            elif isinstance(cmd, FollowPolicy):
                view = self._view = PolicyView(cmd.worker_id, cmd.default_gamma, cmd.ttl_s)
                engine.set_gamma_policy(lambda batch: view.gamma(batch, time.time()))
                self._residency = None
                self._follow_residency(engine)
            elif isinstance(cmd, UpdatePolicy):
                if self._view is not None and self._view.update(cmd.policy):
                    self._follow_residency(engine)
            elif isinstance(cmd, SetResidency):
                _set_residency(engine, cmd.residency)

    def _follow_residency(self, engine) -> None:
        """Hand the engine the view's residency when its answer changes (only then: a SetResidency
        in between stands until the view says something new)."""
        if self._view is None:
            return
        wanted = self._view.residency(time.time())
        if wanted != self._residency:
            self._residency = wanted
            _set_residency(engine, wanted)


def _set_residency(engine, directive: str) -> None:
    try:
        engine.set_draft_residency(directive)
    except ValueError as exc:  # a directive it does not know must not kill the engine
        log.error("ignoring residency directive: %s", exc)


def _snapshot(engine, gamma: int, steps: int, view: PolicyView | None) -> Snapshot:
    return Snapshot(
        steps=steps, policy_version=view.version if view is not None else -1,
        running=engine.num_running, waiting=engine.num_waiting, kv_blocks_free=engine.kv_blocks_free,
        kv_blocks_total=engine.kv_blocks_total, gamma=gamma, draft_residency=str(engine.draft_residency),
        max_context_tokens=int(engine.max_context_tokens),
        memory_bytes=tuple(engine.memory.parts().as_dict().items()),
    )
