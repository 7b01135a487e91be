"""Restart a stack's services that die, with backoff, and say so: what ``nightjar serve`` runs.

A service that exits unasked is restarted after 1 s, then 2, 4, … up to ``max_delay_s`` while it
keeps dying soon after each start; one that stayed up ``stable_s`` starts the count again. Its
log is appended to, so the crash stays above the restart. An embedded Redis that dies is
started again on its port at once (empty unless it keeps an AOF); the services reconnect to it
by themselves (docs/reliability.md), so it is restarted first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from nightjar_tools.stack import Service, Stack


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next death is a first one again

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_delay_s or self.stable_s <= 0:
            raise ValueError("need 0 < first_s <= max_delay_s and stable_s > 0")

    def delay_s(self, quick_deaths: int) -> float:
        """Seconds to wait before the restart that follows ``quick_deaths`` deaths in a row (>= 1)."""
        return min(self.max_delay_s, self.first_s * 2.0 ** max(0, quick_deaths - 1))


class Supervisor:
    """Call ``tick`` every second or so; it never blocks."""

    def __init__(self, stack: Stack, backoff: Backoff = Backoff(), log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stack, self.backoff, self.log, self.clock = stack, backoff, log, clock
        now = clock()
        self._started = {id(s): now for s in stack.services}
        self._deaths: dict[int, int] = {}  # quick deaths in a row, per service
        self._due: dict[int, float] = {}  # restart time of each dead service
        self.restarts = 0

    def tick(self) -> None:
        now = self.clock()
        redis = self.stack.redis
        if redis is not None and not redis.alive():
            self.log(f"nightjar: the embedded Redis exited with {redis.proc.returncode if redis.proc else None}; "
                     "starting it again on the same port")
            redis.restart()
            self.restarts += 1
        for svc in self.stack.services:
            key = id(svc)
            if svc.alive():
                continue
            if key not in self._due:
                up_s = now - self._started.get(key, now)
                deaths = 1 if up_s >= self.backoff.stable_s else self._deaths.get(key, 0) + 1
                self._deaths[key] = deaths
                delay = self.backoff.delay_s(deaths)
                self._due[key] = now + delay
                self.log(f"nightjar: {svc.name} exited with {svc.proc.returncode if svc.proc else None} after "
                         f"{up_s:.0f} s; restarting it in {delay:.0f} s (see {svc.log_path})")
            elif now >= self._due[key]:
                del self._due[key]
                self._restart(svc, now)

    def _restart(self, svc: Service, now: float) -> None:
        self.stack.relaunch(svc)
        self._started[id(svc)] = now
        self.restarts += 1
        self.log(f"nightjar: {svc.name} restarted (pid {svc.proc.pid})")
