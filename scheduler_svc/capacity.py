"""Which worker gets the next job: the one with the most free capacity (pure logic).

A worker's free capacity is its tightest resource, as a fraction: free sequence slots
(max_running - running - waiting) over max_running, and free KV blocks over total. Jobs
assigned since the worker's last heartbeat count as waiting, so a burst of jobs between two
heartbeats spreads out instead of all landing on the worker that looked emptiest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nightjar.messages import Heartbeat


def free_fraction(hb: Heartbeat, extra_waiting: int = 0) -> float:
    slots = (hb.max_running - hb.running - hb.waiting - extra_waiting) / max(1, hb.max_running)
    kv = hb.kv_blocks_free / max(1, hb.kv_blocks_total)
    return min(slots, kv)


@dataclass
class CapacityView:
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    # worker -> unix_ms of each assignment not yet visible in a heartbeat
    _recent: dict[str, list[int]] = field(default_factory=dict)

    def refresh(self, alive: dict[str, Heartbeat]) -> None:
        """Replace the view with the live workers' latest heartbeats."""
        self.heartbeats = dict(alive)
        for worker, times in list(self._recent.items()):
            hb = alive.get(worker)
            if hb is None:
                del self._recent[worker]
            else:  # the heartbeat already counts what was assigned before it was taken
                self._recent[worker] = [t for t in times if t > hb.unix_ms]

    def assigned(self, worker: str, unix_ms: int) -> None:
        self._recent.setdefault(worker, []).append(unix_ms)

    def pick(self, exclude: frozenset[str] | set[str] = frozenset()) -> str | None:
        """The live worker with the most free capacity, ties to more free KV blocks then id
        (a draining worker takes nothing new)."""
        best, best_key = None, None
        for worker, hb in self.heartbeats.items():
            if worker in exclude or hb.draining:
                continue
            key = (free_fraction(hb, len(self._recent.get(worker, ()))), hb.kv_blocks_free, worker)
            if best_key is None or key > best_key:
                best, best_key = worker, key
        return best


@dataclass
class ProgressView:
    """Which workers hold work but take no engine step: alive is making progress.

    A worker whose engine hangs (a stuck kernel, a stopped engine process, a deadlock) keeps
    heartbeating from its event loop, so its heartbeat alone would keep its requests waiting
    forever. A worker with requests running or waiting whose ``engine_steps`` has not moved
    for ``stall_s`` is stalled: dead for dispatch, and its jobs are re-dispatched.
    """

    stall_s: float
    _moved: dict[str, tuple[int, float]] = field(default_factory=dict)  # worker -> (steps, when last moved or idle)

    def stalled(self, alive: dict[str, Heartbeat], now_s: float) -> set[str]:
        out = set()
        for worker, hb in alive.items():
            steps, since = self._moved.get(worker, (None, now_s))
            if steps != hb.engine_steps or hb.running + hb.waiting == 0:
                self._moved[worker] = (hb.engine_steps, now_s)
            elif now_s - since >= self.stall_s:
                out.add(worker)
        for worker in set(self._moved) - set(alive):
            del self._moved[worker]
        return out
