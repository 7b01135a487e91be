"""Retry policy: exponential backoff with jitter, the server's retry-after hint, and one deadline.

Pure logic with an injected clock and random source, so the tests drive it without sleeping.
Only ``UNAVAILABLE`` and ``RESOURCE_EXHAUSTED`` are retried (``NightjarError.retryable``);
``INVALID_ARGUMENT`` and everything else fail at once. The caller also never retries a stream
that has already yielded tokens: the tokens cannot be taken back.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from .errors import DeadlineExceeded, NightjarError, ResourceExhausted


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before retry n (0-based) = min(max_backoff_s, initial_backoff_s * multiplier**n),
    scaled by a uniform factor in [1 - jitter, 1] ("full jitter" when jitter = 1), and never less
    than the server's retry-after hint (itself capped at max_retry_after_s and jittered up by 10%
    so that the clients it turned away do not all come back in the same millisecond).
    """

    max_attempts: int = 5  # first try included; 1 = never retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5  # 0 = none, 1 = full jitter
    max_retry_after_s: float = 30.0  # a hint larger than this is treated as this

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (1 = no retries), got {self.max_attempts}")
        if not (self.initial_backoff_s >= 0 and self.max_backoff_s >= self.initial_backoff_s):
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** retry)
        return base * (1.0 - self.jitter * rng.random())

    def delay_s(self, retry: int, error: NightjarError, rng: random.Random) -> float | None:
        """Seconds to wait before retry number ``retry`` (0 = first retry), or None to give up."""
        if not error.retryable or retry + 1 >= self.max_attempts:
            return None
        delay = self.backoff_s(retry, rng)
        if isinstance(error, ResourceExhausted) and error.retry_after_s is not None:
            hint = min(error.retry_after_s, self.max_retry_after_s)
            delay = max(delay, hint * (1.0 + 0.1 * rng.random()))
        return delay


NO_RETRY = RetryPolicy(max_attempts=1)


class Attempts:
    """The retry state of one call: which retry comes next and how much of the deadline is left."""

    def __init__(self, policy: RetryPolicy, deadline_s: float | None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0 seconds (or None for none), got {deadline_s}")
        self.policy = policy
        self.clock = clock
        self.rng = rng or random.Random()
        self.retries = 0
        self.deadline = None if deadline_s is None else clock() + deadline_s

    def remaining_s(self) -> float | None:
        """The timeout for the next attempt; raises DeadlineExceeded once the deadline has passed."""
        if self.deadline is None:
            return None
        left = self.deadline - self.clock()
        if left <= 0:
            raise DeadlineExceeded("DEADLINE_EXCEEDED: the call's deadline passed before it could complete")
        return left

    def next_delay(self, error: NightjarError) -> float | None:
        """How long to sleep before the next attempt, or None: raise ``error``."""
        delay = self.policy.delay_s(self.retries, error, self.rng)
        if delay is None:
            return None
        if self.deadline is not None and self.clock() + delay >= self.deadline:
            return None  # sleeping would use up the deadline: report the real error instead
        self.retries += 1
        return delay
