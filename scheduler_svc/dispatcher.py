"""The scheduler: queued jobs -> the freest live worker; dead workers' jobs -> another worker.

All state is in Redis (the requests stream's consumer group, assignment hashes, per-worker
assignment sets), so a scheduler can be killed and restarted at any moment:
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from nightjar.deadline import RedisClock, forwarded, remaining_ms
from nightjar.dispatch_lease import lease_entry
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, Job, MessageError, OutputChunk
from nightjar.service_util import REDIS_LOST_ERRORS, now_ms, stop_tasks
from nightjar.streams import dead_letter, ensure_group
from scheduler_svc.capacity import CapacityView, ProgressView
from scheduler_svc.config import SchedulerConfig

log = logging.getLogger("scheduler")

CLOCK_SYNC_S = 10.0  # re-measure Redis' clock this often (hosts drift slowly)

# KEYS: the worker's assignment set, its inbox, the workers set; ARGV: the worker.
FORGET_WORKER = """
if redis.call('SCARD', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""


class Dispatcher:
    """- a job is XACKed (and deleted) in the same MULTI that puts it in a worker's inbox and records
      the assignment, so it is never both lost and acknowledged;
    - entries a dead scheduler left pending are reclaimed with XAUTOCLAIM after ``claim_idle_ms``;
      an entry delivered more than ``max_deliveries`` times (a poison job) is dead-lettered;
    - a worker whose heartbeat key expired has its unfinished assignments re-sent, attempt + 1; so
      does a stalled one (work in hand, no engine step for ``stall_s``: capacity.ProgressView),
      which is also left out of dispatch and the lease table until its engine moves again;
    - no loop dies on an exception: one that is not Redis's is logged with its traceback, the entry
      that caused it (an undecodable job, an assignment record that is not one) is dead-lettered,
      and the loop goes on (a dead loop left the scheduler heartbeating nothing: it looked alive).

    With every heartbeat check it also re-publishes the lease table (nightjar.dispatch_lease): the
    live workers a gateway may put jobs into directly, by the same capacity measure. Jobs leased
    that way never pass through here but leave the same records, so re-dispatch covers them too.
    """

    def __init__(self, cfg: SchedulerConfig, redis: aioredis.Redis) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.key_prefix)
        self.redis = redis
        self.capacity = CapacityView()
        self.progress = ProgressView(cfg.stall_s)
        self._stalled: set[str] = set()  # as of the last refresh
        self._stall_handled: set[str] = set()  # stalled workers whose jobs were re-dispatched
        self._backlog: dict[bytes, Job] = {}  # read but no live worker yet; still pending in the group
        self._workers_seen = asyncio.Event()
        self.clock = RedisClock()  # job deadlines are budgets counted on Redis' clock
        self._clock_synced = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        await self.ensure_group()
        await self.clock.sync(self.redis)
        await self.refresh_workers()
        tasks = [asyncio.create_task(c, name=c.__name__) for c in
                 (self._dispatch_loop(stop), self._reclaim_loop(stop), self._watch_loop(stop))]
        try:
            await stop.wait()
        finally:
            await stop_tasks(tasks, log)
            try:  # without a scheduler, gateways queue jobs for the next one to pick up
                await self.redis.delete(self.keys.leases)
            except REDIS_LOST_ERRORS:
                pass

    async def ensure_group(self) -> None:
        await ensure_group(self.redis, self.keys.requests, self.keys.scheduler_group)

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_loop(self, stop: asyncio.Event) -> None:
        # First our own pending entries (a restart under the same consumer name), then new ones.
        start = b"0"
        while not stop.is_set():
            try:
                if self._backlog:
                    await self._retry_backlog()
                block = 50 if self._backlog else self.cfg.read_block_ms
                reply = await self.redis.xreadgroup(
                    self.keys.scheduler_group, self.cfg.consumer, {self.keys.requests: start},
                    count=self.cfg.read_count, block=None if start == b"0" else block)
                entries = reply[0][1] if reply else []
                if start == b"0" and not entries:
                    start = b">"
                    continue
                if start == b"0":
                    start = entries[-1][0]  # keep paging through our history
                await self.handle(entries, deliveries=1)
            except REDIS_LOST_ERRORS as exc:
                log.warning("dispatch: Redis error (%s); retrying", exc)
                if "NOGROUP" in str(exc):  # Redis came back empty: the consumer group went with it
                    start = b"0"
                    try:
                        await self.ensure_group()
                    except REDIS_LOST_ERRORS:
                        pass
                await asyncio.sleep(0.5)
            except Exception:  # entries it left pending are reclaimed, counted, and dead-lettered in the end
                log.exception("dispatch: unexpected error; going on")
                await asyncio.sleep(0.5)

    async def handle(self, entries, deliveries: int | dict[bytes, int]) -> None:
        """Dispatch one batch of queue entries in one MULTI (or park them without a worker)."""
        now = now_ms()
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, fields in entries:
            n = deliveries if isinstance(deliveries, int) else deliveries.get(entry_id, 1)
            if fields is None:  # deleted while pending (Redis 6.2 returns it without fields)
                self._ack(pipe, entry_id)
                continue
            raw = fields.get(b"job", b"")
            try:
                self._handle_one(pipe, entry_id, raw, n, now)
            except Exception as exc:  # one bad entry must not take the batch (or the loop) with it
                log.exception("dead-lettering entry %s: unexpected error", entry_id)
                self._backlog.pop(entry_id, None)
                self._dead_letter(pipe, entry_id, f"{type(exc).__name__}: {exc}", n, raw, now)
        if len(pipe):
            await pipe.execute()

    def _handle_one(self, pipe, entry_id: bytes, raw: bytes, n: int, now: int) -> None:
        try:
            job = Job.decode(raw)
        except MessageError as exc:
            log.error("dead-lettering undecodable entry %s: %s", entry_id, exc)
            self._dead_letter(pipe, entry_id, str(exc), n, raw, now)
            return
        if n > self.cfg.max_deliveries:
            log.error("dead-lettering %s (%s): delivered %d times", entry_id, job.request_id, n)
            self._dead_letter(pipe, entry_id, f"delivered {n} times (max {self.cfg.max_deliveries})", n, raw, now)
            return
        left_ms = remaining_ms(job, entry_id, self.clock)
        if left_ms is not None and left_ms <= 0:
            self._finish_with_error(pipe, job, "deadline", "the deadline passed while the request was queued")
            self._ack(pipe, entry_id)
            return
        worker = self.capacity.pick()
        if worker is None:
            self._backlog[entry_id] = job
            return
        self._backlog.pop(entry_id, None)
        if job.deadline_budget_ms > 0:  # the inbox entry counts from now: write what is left
            job = forwarded(job, left_ms)
            raw = job.encode()
        self._assign(pipe, job, worker, now, raw)
        self._ack(pipe, entry_id)

    async def _retry_backlog(self) -> None:
        if self.capacity.pick() is None:
            return
        ids = list(self._backlog)
        # Re-read the parked entries (JUSTID would not return fields; we kept the jobs).
        await self.handle([(i, {b"job": self._backlog[i].encode()}) for i in ids], deliveries=1)

    def _assign(self, pipe, job: Job, worker: str, now: int, raw: bytes | None = None) -> None:
        k = self.keys
        raw = raw or job.encode()  # forward the queue entry's bytes as they are: no re-encoding on the hot path
        pipe.xadd(k.inbox(worker), {b"job": raw})
        pipe.hset(k.assignment(job.request_id), mapping={b"worker": worker, b"job": raw, b"assigned_unix_ms": now})
        pipe.pexpire(k.assignment(job.request_id), int(self.cfg.assignment_ttl_s * 1000))
        pipe.sadd(k.worker_assignments(worker), job.request_id)
        self.capacity.assigned(worker, now)

    def _ack(self, pipe, entry_id: bytes) -> None:
        # Deleting as well keeps XLEN = undispatched jobs, which is what the gateway's cap reads.
        pipe.xack(self.keys.requests, self.keys.scheduler_group, entry_id)
        pipe.xdel(self.keys.requests, entry_id)

    def _dead_letter(self, pipe, entry_id: bytes, reason: str, n: int, raw: bytes, now: int) -> None:
        dead_letter(pipe, self.keys, entry_id.decode(), reason, raw, now, n, self.cfg.dead_letter_maxlen)
        self._ack(pipe, entry_id)
        # A decodable poison job still owes its client an answer.
        try:
            job = Job.decode(raw)
        except MessageError:
            return
        self._finish_with_error(pipe, job, "error", f"request dead-lettered: {reason}")

    def _finish_with_error(self, pipe, job: Job, reason: str, error: str) -> None:
        out = self.keys.output(job.request_id)
        pipe.xadd(out, {b"c": OutputChunk(request_id=job.request_id, index=0, finish_reason=reason, error=error).encode()})
        pipe.pexpire(out, int(self.cfg.output_ttl_s * 1000))

    # ------------------------------------------------------------------ reclaim

    async def _reclaim_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.reclaim()
            except REDIS_LOST_ERRORS as exc:
                log.warning("reclaim: Redis error (%s)", exc)
            except Exception:
                log.exception("reclaim: unexpected error; going on")
            await asyncio.sleep(self.cfg.claim_interval_s)

    async def reclaim(self) -> int:
        """Take over entries another (dead) consumer left pending; returns how many."""
        k = self.keys
        if self._backlog:  # touch our parked entries so that nobody (us included) reclaims them
            await self.redis.xclaim(k.requests, k.scheduler_group, self.cfg.consumer, 0, list(self._backlog), justid=True)
        total, cursor = 0, "0-0"
        while True:
            reply = await self.redis.xautoclaim(k.requests, k.scheduler_group, self.cfg.consumer,
                                                self.cfg.claim_idle_ms, start_id=cursor, count=self.cfg.read_count)
            cursor, entries = reply[0], reply[1]
            entries = [(i, f) for i, f in entries if i not in self._backlog]
            if entries:
                pipe = self.redis.pipeline(transaction=False)
                for entry_id, _ in entries:
                    pipe.xpending_range(k.requests, k.scheduler_group, min=entry_id, max=entry_id, count=1)
                counts = {e[0]["message_id"]: e[0]["times_delivered"] for e in await pipe.execute() if e}
                log.warning("reclaimed %d pending entries from a dead scheduler", len(entries))
                await self.handle(entries, deliveries=counts)
                total += len(entries)
            if cursor in (b"0-0", "0-0"):
                return total

    # ------------------------------------------------------------------ workers

    async def _watch_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if time.monotonic() - self._clock_synced > CLOCK_SYNC_S:
                    await self.clock.sync(self.redis)
                    self._clock_synced = time.monotonic()
                dead = await self.refresh_workers()
                for worker in dead:
                    if await self.redispatch(worker) and worker in self._stalled:
                        self._stall_handled.add(worker)
            except REDIS_LOST_ERRORS as exc:
                log.warning("watch: Redis error (%s)", exc)
            except Exception:
                log.exception("watch: unexpected error; going on")
            await asyncio.sleep(self.cfg.heartbeat_check_s)

    async def refresh_workers(self) -> list[str]:
        """Update the capacity view and the lease table from heartbeats; return the workers
        whose jobs must be re-dispatched: heartbeat expired, or newly stalled."""
        workers = sorted(w.decode() for w in await self.redis.smembers(self.keys.workers))
        beats = await self.redis.mget([self.keys.heartbeat(w) for w in workers]) if workers else []
        alive, dead = {}, []
        for worker, raw in zip(workers, beats):
            if raw is None:
                dead.append(worker)
                continue
            try:
                alive[worker] = Heartbeat.decode(raw)
            except MessageError as exc:
                log.error("ignoring malformed heartbeat of %s: %s", worker, exc)
        stalled = self.progress.stalled(alive, time.monotonic())
        for worker in sorted(stalled - self._stall_handled):
            hb = alive[worker]
            log.warning("worker %s is stalled: %d running, %d waiting, no engine step for %gs; re-dispatching its jobs",
                        worker, hb.running, hb.waiting, self.cfg.stall_s)
            dead.append(worker)
        self._stall_handled &= stalled  # moving again: a later stall is a new one
        self._stalled = stalled
        alive = {w: hb for w, hb in alive.items() if w not in stalled}
        self.capacity.refresh(alive)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.leases)
            leased = {w: lease_entry(hb) for w, hb in alive.items() if not hb.draining}
            if leased:
                pipe.hset(self.keys.leases, mapping=leased)
                pipe.pexpire(self.keys.leases, int(self.cfg.lease_ttl_s * 1000))
            await pipe.execute()
        return dead

    async def redispatch(self, dead_worker: str) -> bool:
        """Send every unfinished job of a dead (or stalled) worker to a live one (attempt + 1);
        False when some must wait: for a live worker, or a job that reached it meanwhile."""
        k = self.keys
        rids = [r.decode() for r in await self.redis.smembers(k.worker_assignments(dead_worker))]
        for rid in rids:
            record = await self.redis.hgetall(k.assignment(rid))
            if not record or record.get(b"worker", b"").decode() != dead_worker:
                await self.redis.srem(k.worker_assignments(dead_worker), rid)
                continue
            try:
                job = Job.decode(record.get(b"job", b""))
            except MessageError as exc:  # nothing to re-run: keep it where `nightjar queue dlq` shows it
                log.error("dead-lettering the assignment of %s (worker %s): %s", rid, dead_worker, exc)
                async with self.redis.pipeline(transaction=True) as pipe:
                    dl = dead_letter(pipe, k, f"assign:{rid}", f"assignment record of dead worker {dead_worker}: {exc}",
                                     record.get(b"job", b""), now_ms(), maxlen=self.cfg.dead_letter_maxlen)
                    self._finish_with_error(pipe, Job(rid, (), {}), "error", f"request dead-lettered: {dl.reason}")
                    pipe.delete(k.assignment(rid))
                    pipe.srem(k.worker_assignments(dead_worker), rid)
                    await pipe.execute()
                continue
            pipe = self.redis.pipeline(transaction=True)
            if await self.redis.exists(k.cancel(rid)):
                pipe.delete(k.assignment(rid))
            elif job.attempt + 1 >= self.cfg.max_attempts:
                log.error("request %s failed on %d workers; giving up", rid, job.attempt + 1)
                self._finish_with_error(pipe, job, "error", f"the request's worker died {job.attempt + 1} times")
                pipe.delete(k.assignment(rid))
            else:
                target = self.capacity.pick(exclude={dead_worker})
                if target is None:
                    return False  # no live worker yet: try again on the next check
                log.warning("re-dispatching %s from dead worker %s to %s (attempt %d)", rid, dead_worker, target, job.attempt + 1)
                self._assign(pipe, job.replace(attempt=job.attempt + 1), target, now_ms())
            pipe.srem(k.worker_assignments(dead_worker), rid)
            await pipe.execute()
        if not await self.forget(dead_worker):
            return False  # a job reached it meanwhile: the next check moves it
        log.info("worker %s is gone (heartbeat expired or stalled); forgotten", dead_worker)
        return True

    async def forget(self, worker: str) -> bool:
        """Delete ``worker``'s inbox and membership if it holds no assignment, in one step: the
        dispatch loop may still put a job there from the view before this check (and a
        check-then-delete lost such a job for good once the worker heartbeat again)."""
        k = self.keys
        return bool(await self.redis.eval(FORGET_WORKER, 3, k.worker_assignments(worker), k.inbox(worker), k.workers,
                                          worker))
