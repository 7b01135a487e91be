"""The operations of ``nightjar queue`` that change Redis (each needs ``--yes``)."""

from __future__ import annotations

from typing import Any

import redis

from nightjar.keys import Keys
from nightjar.messages import DeadLetter, Job, MessageError, PolicyHold

from .reader import payload


class MutationError(ValueError):
    """The requested change cannot be made; the message says why."""


def requeue(r: redis.Redis, keys: Keys, dead_letter_id: str, now_ms: int, dry_run: bool = False) -> dict[str, Any]:
    """Put a dead-lettered job back at the end of the requests queue and drop its dead letter.

    The scheduler already wrote an error final chunk to the request's output stream when it
    dead-lettered the job; that stale stream is deleted too, so the re-run's output is the only one.
    """
    entries = r.xrange(keys.dead_letters, min=dead_letter_id, max=dead_letter_id, count=1)
    if not entries:
        raise MutationError(f"no dead letter with id {dead_letter_id!r} (list them with `nightjar queue dlq`)")
    try:
        dl = DeadLetter.decode(payload(entries[0][1], b"dl"))
        job = Job.decode(dl.payload)
    except MessageError as exc:
        raise MutationError(f"dead letter {dead_letter_id} cannot be requeued: {exc}; purge it instead") from None
    result: dict[str, Any] = {
        "action": "requeue", "dead_letter_id": dead_letter_id, "request_id": job.request_id, "dry_run": dry_run,
        "deadline_passed": bool(job.deadline_unix_ms and job.deadline_unix_ms <= now_ms),
    }
    if dry_run:
        return result
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.requests, {b"job": dl.payload})
        pipe.xdel(keys.dead_letters, dead_letter_id)
        pipe.delete(keys.output(job.request_id))
        new_id, _, _ = pipe.execute()
    result["requests_entry_id"] = new_id.decode() if isinstance(new_id, bytes) else str(new_id)
    return result


def purge(r: redis.Redis, keys: Keys, dry_run: bool = False) -> dict[str, Any]:
    """Delete every dead letter."""
    if dry_run:
        count = r.xlen(keys.dead_letters)
    else:
        with r.pipeline(transaction=True) as pipe:  # count exactly what is deleted
            pipe.xlen(keys.dead_letters)
            pipe.delete(keys.dead_letters)
            count, _ = pipe.execute()
    return {"action": "purge", "purged": 0 if dry_run else count, "would_purge": count, "dry_run": dry_run}


MAX_HOLD_S = 24 * 3600.0


def hold(r: redis.Redis, keys: Keys, spec: str | None, seconds: float, dry_run: bool = False) -> dict[str, Any]:
    """Have the planner publish the static policy ``spec`` in place of its own for ``seconds``
    (``spec`` None: lift a hold now). The key expires, so a forgotten hold ends by itself."""
    from planner_svc.policies import make_static_policy

    if spec is None:
        held = r.get(keys.planner_hold)
        result = {"action": "release", "held": PolicyHold.decode(held).policy if held else None, "dry_run": dry_run}
        if not dry_run:
            r.delete(keys.planner_hold)
        return result
    if not 0 < seconds <= MAX_HOLD_S:
        raise MutationError(f"--for must be in (0, {MAX_HOLD_S:g}] seconds, got {seconds:g}")
    try:  # the planner checks again against its own --gamma-max; 16 is the most any planner has
        make_static_policy(spec, gamma_max=16)
    except ValueError as exc:
        raise MutationError(str(exc)) from None
    if not dry_run:
        r.set(keys.planner_hold, PolicyHold(spec, reason="nightjar queue hold").encode(), px=int(seconds * 1000))
    return {"action": "hold", "policy": spec, "seconds": seconds, "dry_run": dry_run}
