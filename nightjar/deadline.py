"""A request's deadline on the wire: the budget left, counted on Redis' clock.
"""

from __future__ import annotations

from nightjar.messages import Job
from nightjar.service_util import now_ms


class RedisClock:
    """Redis' clock read from this process: ours plus the last measured offset.

    The gateway used to write an absolute time on its own clock (``Job.deadline_unix_ms``), which
    every receiver compared with its own: a worker whose clock ran a second ahead ended requests a
    second early, one behind ran requests whose client had long gone. Now a job carries
    ``deadline_budget_ms``, the milliseconds left when that copy of the job was added to a stream.
    The stream entry id is Redis' own millisecond clock at that moment, so a receiver knows how
    long the entry waited by reading Redis' clock (``RedisClock``: its offset from ours, measured
    with TIME now and then) and converts the rest to its own clock. Whoever writes the job on to
    another stream writes the budget left at that moment, so the time it spent in each queue
    counts. ``deadline_unix_ms`` from a gateway of the old version is still honoured.
    """

    def __init__(self) -> None:
        self.offset_ms = 0

    async def sync(self, redis) -> None:
        before = now_ms()
        seconds, micros = await redis.time()
        after = now_ms()
        self.offset_ms = seconds * 1000 + micros // 1000 - (before + after) // 2

    def now_ms(self) -> int:
        return now_ms() + self.offset_ms


def entry_ms(entry_id: bytes | str) -> int:
    """When a stream entry was added, on Redis' clock (the first half of its id)."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


def remaining_ms(job: Job, entry_id: bytes | str, clock: RedisClock) -> int | None:
    """Milliseconds left of the job's budget now, or None when it has no deadline."""
    if job.deadline_budget_ms > 0:
        return job.deadline_budget_ms - max(0, clock.now_ms() - entry_ms(entry_id))
    if job.deadline_unix_ms:  # a gateway of the previous wire version: its own clock
        return job.deadline_unix_ms - now_ms()
    return None


def forwarded(job: Job, left_ms: int | None) -> Job:
    """The job to write on to the next stream: its budget is what is left now."""
    if left_ms is None or job.deadline_budget_ms <= 0:
        return job
    return job.replace(deadline_budget_ms=max(1, left_ms))
