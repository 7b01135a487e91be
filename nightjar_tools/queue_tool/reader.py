"""Read the live Redis state into plain JSON-able dicts (one method per ``nightjar queue`` view).

Read-only: every method here only reads (XRANGE, XPENDING, GET, HGETALL, SMEMBERS, SCAN).
The two mutating operations live in ``mutate.py``. Entries that fail to decode are reported
with an ``error`` field and never stop the listing: a poison entry is exactly what an operator
runs this tool to find.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import redis

from nightjar.keys import Keys
from nightjar.messages import DeadLetter, Heartbeat, Job, Message, MessageError, OutputChunk, Policy, StepStats

ROW_LIMIT = 1000  # most rows one listing reads; the total is always reported beside it


def _s(v: bytes | str) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def entry_ms(entry_id: str) -> int:
    """The creation time in a stream entry id (``<ms>-<seq>``)."""
    try:
        return int(entry_id.split("-", 1)[0])
    except ValueError:
        return 0


def payload(fields: dict, preferred: bytes) -> bytes:
    """The entry's payload: field ``preferred``, or its only field whatever the writer named it."""
    if preferred in fields:
        return fields[preferred]
    if len(fields) == 1:
        return next(iter(fields.values()))
    raise MessageError(f"entry has fields {sorted(_s(k) for k in fields)}, none named {_s(preferred)!r}")


def decode(cls: type[Message], raw: bytes | None) -> tuple[Any, str | None]:
    if raw is None:
        return None, "missing"
    try:
        return cls.decode(raw), None
    except MessageError as exc:
        return None, str(exc)


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


class QueueReader:
    """Layout (see nightjar/keys.py): jobs wait in ``keys.requests`` (field ``job``; the scheduler
    XDELs an entry once dispatched, so XLEN = waiting), assignments are hashes ``keys.assignment``
    (``worker``, ``job``, ``assigned_unix_ms``) indexed by ``keys.worker_assignments`` sets, output
    chunks are in ``keys.output`` (field ``c``), heartbeats are plain keys, step statistics and
    dead letters are streams, the policy is a plain key.
    """

    def __init__(self, r: redis.Redis, keys: Keys, now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 limit: int = ROW_LIMIT) -> None:
        self.r = r
        self.keys = keys
        self.now_ms = now_ms
        self.limit = limit

    def _age_s(self, unix_ms: int) -> float | None:
        return _round((self.now_ms() - unix_ms) / 1000.0) if unix_ms > 0 else None

    # ------------------------------------------------------------------ ls
    def ls(self) -> dict[str, Any]:
        """Requests waiting in the queue (not yet dispatched to a worker)."""
        k = self.keys
        total = self.r.xlen(k.requests)
        entries = self.r.xrange(k.requests, count=self.limit)
        deliveries = self._deliveries(k.requests, k.scheduler_group, entries)
        rows = []
        for entry_id, fields in entries:
            eid = _s(entry_id)
            row: dict[str, Any] = {"entry_id": eid, "deliveries": deliveries.get(eid, 0)}
            try:
                job, err = decode(Job, payload(fields, b"job"))
            except MessageError as exc:
                job, err = None, str(exc)
            if job is None:
                row.update(request_id=None, age_s=self._age_s(entry_ms(eid)), error=err)
            else:
                row.update(request_id=job.request_id, age_s=self._age_s(job.enqueued_unix_ms or entry_ms(eid)),
                           prompt_tokens=len(job.prompt_token_ids), max_tokens=job.params.get("max_tokens"),
                           attempt=job.attempt,
                           deadline_in_s=self._deadline_in_s(job, eid),
                           error=None)
            rows.append(row)
        return {"waiting": total, "shown": len(rows), "requests": rows}

    def _deadline_in_s(self, job: Job, eid) -> float | None:
        if job.deadline_budget_ms > 0:  # counted from the entry's id (nightjar/deadline.py)
            return _round((job.deadline_budget_ms - max(0, self.now_ms() - entry_ms(eid))) / 1000.0)
        if job.deadline_unix_ms:
            return _round((job.deadline_unix_ms - self.now_ms()) / 1000.0)
        return None

    def _deliveries(self, stream: str, group: str, entries: list) -> dict[str, int]:
        """Delivery count per entry id (0 = never read by a consumer)."""
        if not entries:
            return {}
        try:
            pending = self.r.xpending_range(stream, group, min=entries[0][0], max=entries[-1][0],
                                            count=len(entries))
        except redis.ResponseError:  # no group yet: nothing was ever delivered
            return {}
        return {_s(p["message_id"]): int(p["times_delivered"]) for p in pending}

    # ------------------------------------------------------------------ inflight
    def inflight(self) -> dict[str, Any]:
        """Assigned requests per worker, with how far each has got."""
        k = self.keys
        rows = []
        for worker in self._worker_ids():
            rids = sorted(_s(x) for x in self.r.smembers(k.worker_assignments(worker)))
            for rid in rids[: self.limit]:
                rows.append(self._assignment_row(worker, rid))
        return {"total": len(rows), "requests": rows}

    def _assignment_row(self, worker: str, rid: str) -> dict[str, Any]:
        k = self.keys
        rec = self.r.hgetall(k.assignment(rid))
        row: dict[str, Any] = {"worker": worker, "request_id": rid}
        if not rec:
            row.update(error="assignment record missing (finished, expired, or being re-dispatched)")
            return row
        assigned_to = _s(rec.get(b"worker", b""))
        assigned_ms = int(rec.get(b"assigned_unix_ms", b"0") or 0)
        job, err = decode(Job, rec.get(b"job"))
        row.update(assigned_to=assigned_to, age_s=self._age_s(assigned_ms))
        if job is None:
            row.update(error=f"job: {err}")
            return row
        max_tokens = job.params.get("max_tokens")
        generated, finished, out_err = self._progress(rid)
        row.update(attempt=job.attempt, prompt_tokens=len(job.prompt_token_ids), max_tokens=max_tokens,
                   generated=generated, finish_reason=finished,
                   progress=_round(generated / max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else None,
                   error=out_err)
        return row

    def _progress(self, rid: str) -> tuple[int, str | None, str | None]:
        """(tokens generated so far, finish reason or None, decode error or None) from the output stream."""
        last = self.r.xrevrange(self.keys.output(rid), count=1)
        if not last:
            return 0, None, None
        try:
            chunk, err = decode(OutputChunk, payload(last[0][1], b"c"))
        except MessageError as exc:
            chunk, err = None, str(exc)
        if chunk is None:
            return 0, None, f"output: {err}"
        return chunk.index + len(chunk.token_ids), chunk.finish_reason, None

    # ------------------------------------------------------------------ workers
    def _worker_ids(self) -> list[str]:
        k = self.keys
        ids = {_s(w) for w in self.r.smembers(k.workers)}
        prefix = k.heartbeat("")
        ids |= {_s(key)[len(prefix):] for key in self.r.scan_iter(match=k.heartbeat_pattern, count=500)}
        return sorted(ids)

    def workers(self, stats_window: int = 500) -> dict[str, Any]:
        k = self.keys
        last_step = self._last_step_per_worker(stats_window)
        rows = []
        for worker in self._worker_ids():
            raw = self.r.get(k.heartbeat(worker))
            row: dict[str, Any] = {"worker_id": worker, "alive": raw is not None,
                                   "assigned": self.r.scard(k.worker_assignments(worker)),
                                   "inbox": self.r.xlen(k.inbox(worker))}
            hb, err = decode(Heartbeat, raw) if raw is not None else (None, None)
            if hb is not None:
                row.update(model=hb.model, heartbeat_age_s=self._age_s(hb.unix_ms), running=hb.running,
                           waiting=hb.waiting, max_running=hb.max_running, gamma=hb.gamma,
                           draft_residency=hb.draft_residency, kv_blocks_free=hb.kv_blocks_free,
                           kv_blocks_total=hb.kv_blocks_total, kv_blocks_used=hb.kv_blocks_total - hb.kv_blocks_free,
                           policy_version=hb.policy_version, uptime_s=self._age_s(hb.started_unix_ms))
            step = last_step.get(worker)
            row["batch_size"] = step.batch_size if step else None
            row["error"] = f"heartbeat: {err}" if err else None
            rows.append(row)
        return {"total": len(rows), "alive": sum(r["alive"] for r in rows), "workers": rows}

    def _recent_stats(self, window: int) -> tuple[list[StepStats], list[dict[str, Any]]]:
        entries = self.r.xrevrange(self.keys.stats, count=window)
        good, bad = [], []
        for entry_id, fields in reversed(entries):
            try:
                st, err = decode(StepStats, payload(fields, b"s"))
            except MessageError as exc:
                st, err = None, str(exc)
            if st is None:
                bad.append({"entry_id": _s(entry_id), "error": err})
            else:
                good.append(st)
        return good, bad

    def _last_step_per_worker(self, window: int) -> dict[str, StepStats]:
        good, _ = self._recent_stats(window)
        return {st.worker_id: st for st in good}  # oldest first, so the latest wins

    # ------------------------------------------------------------------ policy
    def policy(self) -> dict[str, Any]:
        raw = self.r.get(self.keys.policy)
        if raw is None:
            return {"policy": None, "error": None}
        pol, err = decode(Policy, raw)
        if pol is None:
            return {"policy": None, "error": err}
        age = self._age_s(pol.unix_ms)
        return {"policy": {
            "version": pol.version, "name": pol.name, "age_s": age, "ttl_s": pol.ttl_s,
            "stale": age is not None and age > pol.ttl_s,
            "buckets": [{"max_batch_size": b, "gamma": g} for b, g in zip(pol.bucket_upper_bounds, pol.gamma_by_bucket)],
            "residency": dict(sorted(pol.residency.items())),
        }, "error": None}

    # ------------------------------------------------------------------ model
    def model(self) -> dict[str, Any]:
        """What the planner has learned (its saved state): per bucket the γ in force, the plays
        per γ, and the predicted step ms and ms per emitted token of every γ at the bucket's
        usual batch size. Only a learning policy with a step-cost model (nightjar) has one."""
        # Imported here: the other views stay free of numpy and the planner's policies.
        import numpy as np

        from nightjar.messages import PlannerState
        from planner_svc.policies import make_policy

        raw = self.r.get(self.keys.planner_state)
        if raw is None:
            return {"model": None, "error": None}
        try:
            state = PlannerState.decode(raw)
            policy = make_policy(state.policy, gamma_max=state.gamma_max, buckets=state.buckets)
            policy.load_state_dict(state.state)
        except (ValueError, KeyError, TypeError) as exc:
            return {"model": None, "error": str(exc)}
        cost = getattr(policy, "cost", None)
        if cost is None:
            return {"model": None, "error": f"policy {state.policy!r} keeps no step-cost model"}
        buckets = []
        for i, tl in enumerate(policy.timelines):
            sizes, weights = tl.support()
            row = {"batch_sizes": [tl.lo, tl.hi], "gamma": tl.arm, "steps": tl.steps, "plays": list(tl.plays),
                   "mean_batch": round(float(weights @ sizes), 2), "block": tl.block}
            if cost.ready:
                step = cost.step_ms(np.array([row["mean_batch"]]), policy.gamma_max)[0]  # [G+1]
                row["step_ms"] = [round(float(x), 3) for x in step]
                row["ms_per_token"] = [round(float(x), 4) for x in policy.losses(i)]
            buckets.append(row)
        return {"model": {"policy": state.policy, "version": state.version,
                          "age_s": self._age_s(state.saved_unix_ms),
                          "updates": policy.updates, "gamma_max": policy.gamma_max, "switches": policy.switches,
                          "prefill_ms_per_token": round(cost.prefill_ms_per_token, 4),
                          "expected_tokens": [round(float(x), 3) for x in policy.acceptance.expected_tokens()],
                          "buckets": buckets}, "error": None}

    # ------------------------------------------------------------------ stats
    def stats(self, window: int = 500) -> dict[str, Any]:
        """Acceptance per draft position and step time per gamma over the last ``window`` steps."""
        steps, bad = self._recent_stats(window)
        accepted: list[int] = []
        offered: list[int] = []
        by_gamma: dict[int, list[StepStats]] = {}
        for st in steps:
            by_gamma.setdefault(st.gamma, []).append(st)
            for i in range(st.gamma):
                if i >= len(offered):
                    offered.append(0)
                    accepted.append(0)
                offered[i] += st.batch_size
                accepted[i] += st.accepted_per_position[i] if i < len(st.accepted_per_position) else 0
        gamma_rows = []
        for gamma in sorted(by_gamma):
            group = by_gamma[gamma]
            times = sorted(s.step_ms for s in group)
            emitted = sum(s.emitted_tokens for s in group)
            gamma_rows.append({
                "gamma": gamma, "steps": len(group),
                "mean_batch_size": _round(statistics.fmean(s.batch_size for s in group)),
                "mean_step_ms": _round(statistics.fmean(times)), "p50_step_ms": _round(_quantile(times, 0.5)),
                "p90_step_ms": _round(_quantile(times, 0.9)),
                "tokens_per_step": _round(emitted / len(group)),
                "ms_per_token": _round(sum(times) / emitted) if emitted else None,
            })
        catchups = [s for s in steps if s.catchup_tokens > 0]
        return {
            "steps": len(steps),
            "window_s": _round((steps[-1].unix_ms - steps[0].unix_ms) / 1000.0) if steps else None,
            "acceptance_per_position": [
                {"position": i, "offered": offered[i], "accepted": accepted[i],
                 "rate": _round(accepted[i] / offered[i]) if offered[i] else None} for i in range(len(offered))],
            "by_gamma": gamma_rows,
            "catchup": {"count": len(catchups), "tokens": sum(s.catchup_tokens for s in catchups),
                        "mean_ms": _round(statistics.fmean(s.catchup_ms for s in catchups)) if catchups else None},
            "preempted": sum(s.preempted for s in steps),
            "preempted_tokens": sum(s.preempted_tokens for s in steps),
            "acceptance_alarms": sum(1 for s in steps if s.acceptance_alarm),
            "errors": bad,
        }

    # ------------------------------------------------------------------ dead letters
    def dlq(self) -> dict[str, Any]:
        k = self.keys
        total = self.r.xlen(k.dead_letters)
        rows = []
        for entry_id, fields in self.r.xrange(k.dead_letters, count=self.limit):
            eid = _s(entry_id)
            try:
                dl, err = decode(DeadLetter, payload(fields, b"dl"))
            except MessageError as exc:
                dl, err = None, str(exc)
            if dl is None:
                rows.append({"id": eid, "age_s": self._age_s(entry_ms(eid)), "error": err})
                continue
            job, job_err = decode(Job, dl.payload) if dl.payload else (None, "empty payload")
            rows.append({"id": eid, "entry_id": dl.entry_id, "reason": dl.reason, "deliveries": dl.deliveries,
                         "age_s": self._age_s(dl.unix_ms or entry_ms(eid)), "payload_bytes": len(dl.payload),
                         "request_id": job.request_id if job else None, "requeueable": job is not None,
                         "error": None if job else f"payload: {job_err}"})
        return {"count": total, "shown": len(rows), "dead_letters": rows}

    def overview(self, stats_window: int = 200) -> dict[str, Any]:
        """Everything ``watch`` shows, read in one go."""
        return {"queue": self.ls(), "inflight": self.inflight(), "workers": self.workers(stats_window),
                "policy": self.policy(), "stats": self.stats(stats_window), "dlq": self.dlq()}


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]
