"""AcceptanceMonitor: the silent-failure guard for speculation.

A draft that silently breaks (wrong weights after a reload, a tokenizer mismatch) does not
crash anything: acceptance just falls to ~0 and speculation quietly costs time. The monitor
averages the acceptance rate (accepted / proposed tokens) over windows of speculative steps;
once a window has been healthy, a later window below the floor raises the alarm (a warning in
the log and StepStats.acceptance_alarm) until a window recovers.
"""

from __future__ import annotations

import logging

log = logging.getLogger("nightjar.engine")


class AcceptanceMonitor:
    def __init__(self, window: int, floor: float, healthy: float) -> None:
        self.window, self.floor, self.healthy = window, floor, healthy
        self._steps = 0
        self._accepted = 0
        self._proposed = 0
        self.seen_healthy = False
        self.alarm = False
        self.last_rate: float | None = None

    def observe(self, gamma: int, batch_size: int, accepted: int) -> bool:
        """One step's totals (accepted draft tokens over all sequences); -> alarm state."""
        if gamma == 0 or batch_size == 0:
            return self.alarm
        self._steps += 1
        self._accepted += accepted
        self._proposed += gamma * batch_size
        if self._steps >= self.window:
            rate = self._accepted / self._proposed
            self.last_rate = rate
            self._steps = self._accepted = self._proposed = 0
            if rate >= self.healthy:
                self.seen_healthy = True
            was = self.alarm
            self.alarm = self.seen_healthy and rate < self.floor
            if self.alarm and not was:
                log.warning("speculation acceptance collapsed to %.3f (was >= %.2f): the draft may be broken; "
                            "speculation is costing time", rate, self.healthy)
            elif was and not self.alarm:
                log.warning("speculation acceptance recovered to %.3f", rate)
        return self.alarm
