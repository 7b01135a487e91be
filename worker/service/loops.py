"""The worker service: Redis on one side (asyncio), the engine loop on the other (a thread, or on
CUDA a child process: worker/host/process.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from nightjar import metrics as m
from nightjar.deadline import RedisClock, forwarded, remaining_ms
from nightjar.keys import Keys
from nightjar.messages import Cancel, Heartbeat, Job, MessageError, OutputChunk, Policy
from nightjar.service_util import REDIS_LOST_ERRORS, REDIS_RETRY_FIRST_S, now_ms, stop_tasks, wait_for_redis
from nightjar.streams import dead_letter, ensure_group
from worker.host.policy_view import follow_policy
from worker.host.process import EngineProcess
from worker.host.protocol import Abort, Add, EngineHost, FollowPolicy, Snapshot, StepResult, UpdatePolicy
from worker.host.thread import EngineThread
from worker.service.config import WorkerServiceConfig
from worker.service.redis_ops import RELEASE_ASSIGNMENT, Ops, delivered_prefix

log = logging.getLogger("worker")
CLOCK_SYNC_S = 10.0  # re-measure Redis' clock this often (hosts drift slowly)


@dataclass
class Active:
    entry_id: bytes
    job: Job
    chunks: int = 0
    offset: int = 0  # tokens delivered by an earlier worker: the engine's index 0 is the completion's index ``offset``


class WorkerService:
    """One task per concern, all on the event loop:

    - inbox: XREADGROUP on its own inbox stream; a job is acknowledged only once its final chunk
      is written (a worker killed mid-request leaves it pending; the scheduler re-dispatches it);
    - outputs: every engine step's chunks go out in one pipelined round trip, with the step's
      stats (capped stream) and the bookkeeping of finished requests (worker/service/redis_ops.py); a
      chunk of a request the scheduler moved to another worker is refused, and our copy aborted;
    - re-dispatched jobs continue from the tokens their client already has (read from the
      request's output stream), never from index 0;
    - cancels: pub/sub for speed, plus a periodic key check for messages missed while reconnecting;
    - heartbeat: a Heartbeat with a TTL every ``heartbeat_interval_s``; the first is sent only once
      the models are loaded (and Redis answers), so the stack is ready exactly when a worker can
      take work; it carries the engine's step count (progress) and, after SIGTERM, ``draining``;
    - policy: follows the planner's key and channel (worker.host.policy_view.follow_policy) and
      hands every policy to the host, whose PolicyView, the worker's only one, answers γ and the
      draft's residency every step; its version comes back in the snapshot.
    """

    def __init__(self, cfg: WorkerServiceConfig, redis: aioredis.Redis, engine_factory=None) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.key_prefix)
        self.redis = redis
        self._injected = engine_factory  # tests hand in their own engines: those run in a thread
        self._factory = engine_factory or self._default_engine
        self._results: asyncio.Queue[StepResult] = asyncio.Queue()
        self.engine: EngineHost | None = None
        self.active: dict[str, Active] = {}  # owned by the event loop
        self.snapshot = Snapshot()
        self.started_ms = now_ms()
        self.clock = RedisClock()  # job deadlines are budgets counted on Redis' clock
        self._moved: set[str] = set()  # active requests another worker took over (being aborted)
        self._accepting = True
        # Set before the tasks are cancelled at shutdown: every loop also checks it, because a
        # cancellation that lands inside a redis-py call can be lost (see gateway/output_reader.py).
        self._closing = False

    def _default_engine(self):
        from worker.engine.engine import Engine

        return Engine(self.cfg.engine)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        loop = asyncio.get_running_loop()
        deliver = lambda r: loop.call_soon_threadsafe(self._results.put_nowait, r)  # noqa: E731
        if self.cfg.use_engine_process and self._injected is None:
            self.engine = EngineProcess(self.cfg.engine, deliver, log_level=self.cfg.log_level)
        else:
            self.engine = EngineThread(self._factory, deliver)
        self.engine.start()
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed to start: {self.engine.error}") from self.engine.error
        self.snapshot = self.engine.snapshot
        if not await self._connect(stop):
            self.engine.stop()
            return
        log.info("worker %s ready (model %s, %d KV blocks)", self.cfg.worker_id, self.cfg.model_name, self.snapshot.kv_blocks_total)
        m.WORKER_READY.set(1)
        tasks = [asyncio.create_task(c, name=c.__name__) for c in (
            self._inbox_loop(stop), self._output_loop(), self._cancel_listener(), self._cancel_poll(),
            self._heartbeat_loop(), self._policy_loop(stop))]
        died = None
        try:
            died = await self._until_stop_or_a_loop_dies(stop, tasks)
            if self.engine.error is None:
                await self._drain()
        finally:
            m.WORKER_READY.set(0)
            self._closing = True
            await stop_tasks(tasks, log)
            self.engine.stop()
            try:  # leave at once instead of waiting for the heartbeat TTL
                await self.redis.delete(self.keys.heartbeat(self.cfg.worker_id))
            except RedisError:
                pass
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed: {self.engine.error}") from self.engine.error
        if died is not None:
            raise RuntimeError(f"the worker's {died.get_name()} died: {died.exception()!r}") from died.exception()

    async def _until_stop_or_a_loop_dies(self, stop: asyncio.Event, tasks: list[asyncio.Task]) -> asyncio.Task | None:
        """Wait for ``stop``; a loop that ends with an exception stops the worker too (it exits
        with an error, so it is restarted and its jobs re-dispatched) rather than leaving a
        process that heartbeats while one of its loops is gone."""
        stopper = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stopper and not task.cancelled() and task.exception() is not None:
                        log.error("%s died; stopping the worker", task.get_name(), exc_info=task.exception())
                        stop.set()
                        return task
                tasks = [t for t in tasks if not t.done()]
            return None
        finally:
            stopper.cancel()

    async def _drain(self) -> None:
        """SIGTERM: say so at once (the heartbeat's ``draining``: the scheduler and the gateways'
        lease script send nothing more), hand back what was sent but not started, let the
        running requests finish for up to ``drain_grace_s``."""
        self._accepting = False
        await self._beat()
        deadline = time.monotonic() + self.cfg.drain_grace_s
        next_hand_back = 0.0
        while self.active and time.monotonic() < deadline:
            # Repeated: a scheduler may still act on the heartbeat it read before this one.
            if time.monotonic() >= next_hand_back:
                await self._hand_back()
                next_hand_back = time.monotonic() + 0.25
            await asyncio.sleep(0.05)
        await self._hand_back()
        if self.active:
            log.warning("stopping with %d requests unfinished; the scheduler re-dispatches them", len(self.active))

    async def _hand_back(self) -> None:
        """Put every inbox job this worker has not started back on the requests stream, as it
        came, so the scheduler gives it to a worker that is not leaving: waiting for the drain
        (and then the heartbeat's expiry) would hold its client for up to ``drain_grace_s``."""
        inbox = self.keys.inbox(self.cfg.worker_id)
        try:
            entries = await self.redis.xrange(inbox, count=1000)
            pipe = self.redis.pipeline(transaction=True)
            handed = []
            for entry_id, fields in entries:
                try:
                    job = Job.decode(fields[b"job"])
                except (KeyError, MessageError):
                    continue  # the inbox loop dead-letters these; nothing to hand back
                if job.request_id in self.active:
                    continue
                raw = fields[b"job"]
                if job.deadline_budget_ms > 0:  # the requests entry counts from now: write what is left
                    raw = forwarded(job, remaining_ms(job, entry_id, self.clock)).encode()
                pipe.xadd(self.keys.requests, {b"job": raw})
                pipe.eval(RELEASE_ASSIGNMENT, 1, self.keys.assignment(job.request_id), self.cfg.worker_id)
                pipe.srem(self.keys.worker_assignments(self.cfg.worker_id), job.request_id)
                pipe.xack(inbox, self.keys.worker_group, entry_id)
                pipe.xdel(inbox, entry_id)
                handed.append(job.request_id)
            if handed:
                await pipe.execute()
                log.info("draining: handed %d unstarted jobs back to the scheduler", len(handed))
        except REDIS_LOST_ERRORS as exc:  # they are re-dispatched when the heartbeat goes
            log.warning("draining: could not hand jobs back (%s)", exc)

    async def _connect(self, stop: asyncio.Event) -> bool:
        """Wait for Redis (the worker may start first), then create the inbox; False if stopped meanwhile."""
        while await wait_for_redis(self.redis, stop, log):
            try:
                await self._ensure_group()
                await self.clock.sync(self.redis)
                return True
            except REDIS_LOST_ERRORS as exc:  # went away again between the ping and here
                log.warning("Redis failed while starting (%s); waiting for it again", exc)
                await asyncio.sleep(REDIS_RETRY_FIRST_S)
        return False

    async def _ensure_group(self) -> None:
        await ensure_group(self.redis, self.keys.inbox(self.cfg.worker_id), self.keys.worker_group)

    # ------------------------------------------------------------------ inbox

    async def _inbox_loop(self, stop: asyncio.Event) -> None:
        inbox, start = self.keys.inbox(self.cfg.worker_id), b"0"  # own pending first (same id restarted)
        while self._accepting:
            try:
                reply = await self.redis.xreadgroup(self.keys.worker_group, self.cfg.worker_id, {inbox: start},
                                                    count=self.cfg.read_count, block=None if start == b"0" else 1000)
                entries = reply[0][1] if reply else []
                if start == b"0":
                    start = b">"
                await self._accept(entries)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # The scheduler thought we were dead and removed our inbox; start a new one.
                    log.warning("inbox was removed (declared dead after a pause?); recreating it")
                    try:
                        await self._ensure_group()
                    except REDIS_LOST_ERRORS as exc2:
                        log.warning("inbox: cannot recreate it yet (%s)", exc2)
                        await asyncio.sleep(0.5)
                    continue
                # BUSY (a script runs past lua-time-limit), LOADING, ...: Redis will answer
                # again; this task dying left a worker that heartbeats but never reads its inbox.
                log.warning("inbox: Redis refused (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except REDIS_LOST_ERRORS as exc:
                log.warning("inbox: Redis error (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def _accept(self, entries) -> None:
        if not self._accepting:  # draining: leave them pending; the scheduler re-sends them once we are gone
            return
        jobs: list[tuple[bytes, Job]] = []
        pipe = Ops()
        for entry_id, fields in entries:
            try:
                job = Job.decode(fields[b"job"])
            except (KeyError, MessageError) as exc:
                log.error("dead-lettering malformed inbox entry %s: %s", entry_id, exc)
                self._dead_letter(pipe, entry_id, fields.get(b"job", b""), str(exc))
                continue
            if job.request_id in self.active:  # delivered twice: the running copy answers
                self._ack(pipe, entry_id)
                continue
            jobs.append((entry_id, job))
        delivered = await self._delivered([job for _, job in jobs if job.attempt > 0])
        started = []
        for entry_id, job in jobs:
            left_ms = remaining_ms(job, entry_id, self.clock)
            if left_ms is not None and left_ms <= 0:
                self._finish(pipe, job.request_id, entry_id, OutputChunk(
                    job.request_id, 0, finish_reason="deadline", error="the deadline passed before the request ran",
                    worker_id=self.cfg.worker_id))
                continue
            try:
                params = job.sampling
            except MessageError as exc:
                self._finish(pipe, job.request_id, entry_id, OutputChunk(
                    job.request_id, 0, finish_reason="error", error=f"bad sampling params: {exc}", worker_id=self.cfg.worker_id))
                continue
            prefix, final = delivered.get(job.request_id, ([], False))
            if final:  # an earlier worker wrote its final chunk and died before acknowledging
                self._ack(pipe, entry_id)
                pipe.released.append(job.request_id)
                pipe.eval(RELEASE_ASSIGNMENT, 1, self.keys.assignment(job.request_id), self.cfg.worker_id)
                continue
            if prefix:
                # Re-dispatched: continue the completion the client already has, not a new one
                # (a sampled request re-run from scratch would splice two samples at index n).
                log.info("resuming request %s at index %d (prefix crc32 %08x)", job.request_id, len(prefix),
                         zlib.crc32(repr(prefix).encode()))
                if params.max_tokens <= len(prefix):
                    self._finish(pipe, job.request_id, entry_id, OutputChunk(
                        job.request_id, len(prefix), finish_reason="length", prompt_tokens=len(job.prompt_token_ids),
                        completion_tokens=len(prefix), worker_id=self.cfg.worker_id))
                    continue
                params = params.replace(max_tokens=params.max_tokens - len(prefix))
            self.active[job.request_id] = Active(entry_id, job, offset=len(prefix))
            self.engine.submit(Add(job.request_id, [*job.prompt_token_ids, *prefix], params))
            started.append(job.request_id)
        # Cancelled before it got here (e.g. while queued or re-dispatched)? Checked after the
        # hand-off so the check's round trip is not on every request's time to first token.
        if started:
            for rid, flag in zip(started, await self.redis.mget([self.keys.cancel(r) for r in started])):
                if flag is not None:
                    self.engine.submit(Abort(rid))
        if len(pipe):
            redis_pipe = self.redis.pipeline(transaction=False)
            self._replay(pipe, redis_pipe)
            await redis_pipe.execute()

    async def _delivered(self, jobs: list[Job]) -> dict[str, tuple[list[int], bool]]:
        """What the clients of re-dispatched jobs have been sent so far. Read after the
        scheduler moved the assignment to us, so the previous worker can add nothing more."""
        if not jobs:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xrange(self.keys.output(job.request_id))
        return {job.request_id: delivered_prefix(entries) for job, entries in zip(jobs, await pipe.execute())}

    def _replay(self, ops: Ops, pipe) -> None:
        ops.replay(pipe, self.keys, self.cfg.worker_id, int(self.cfg.output_ttl_s * 1000))

    def _dead_letter(self, pipe, entry_id: bytes, raw: bytes, reason: str) -> None:
        """Keep a malformed entry (truncated) where `nightjar queue dlq` shows it, then drop it."""
        dead_letter(pipe, self.keys, entry_id.decode(), f"worker {self.cfg.worker_id} inbox: {reason}", raw, now_ms())
        self._ack(pipe, entry_id)

    def _ack(self, pipe: Ops, entry_id: bytes) -> None:
        pipe.acks.append(entry_id)  # XACK + XDEL, after the round trip's output chunks

    def _finish(self, pipe: Ops, request_id: str, entry_id: bytes, final: OutputChunk) -> None:
        """Write the final chunk, then acknowledge and forget the job (same round trip, in order)."""
        self._write(pipe, final, first=True)
        self._ack(pipe, entry_id)
        pipe.released.append(request_id)
        pipe.eval(RELEASE_ASSIGNMENT, 1, self.keys.assignment(request_id), self.cfg.worker_id)

    def _write(self, pipe: Ops, chunk: OutputChunk, first: bool) -> None:
        # A stream nobody reads must not outlive its TTL: set on the first and the final chunk.
        pipe.outputs.append((self.keys.output(chunk.request_id), chunk.encode(), first or chunk.finish_reason is not None,
                             chunk.request_id))

    # ------------------------------------------------------------------ outputs

    async def _output_loop(self) -> None:
        while not self._closing:
            results = [await self._results.get()]
            while not self._results.empty():  # fell behind: one round trip for several steps
                results.append(self._results.get_nowait())
            if self.engine.error is not None:
                log.error("the engine failed: %s; stopping so the scheduler re-dispatches", self.engine.error)
                self._accepting = False
                self._stop.set()
                return
            ops = Ops()
            for result in results:
                self._queue_result(ops, result)
            if results[-1].snapshot.draft_residency != self.snapshot.draft_residency:
                m.set_residency(results[-1].snapshot.draft_residency)
            if results[-1].snapshot.policy_version != self.snapshot.policy_version:
                m.POLICY_VERSION.set(results[-1].snapshot.policy_version)
            self.snapshot = results[-1].snapshot
            await self._write_until_done(ops)
            for result in results:
                if result.stats is not None:
                    m.observe_step(result.stats)
            snap = self.snapshot
            m.observe_engine_state(snap.running, snap.waiting, snap.kv_blocks_free, snap.kv_blocks_total)

    async def _write_until_done(self, ops: "Ops") -> None:
        """One round trip for a batch of steps, retried until Redis takes it: a dropped chunk
        would leave a gap in a client's stream, a dropped final record a client waiting forever.
        Every op is idempotent or deduplicated by index, so replaying a partial write is safe."""
        delay_s = 0.1
        while len(ops):
            pipe = self.redis.pipeline(transaction=False)
            self._replay(ops, pipe)
            try:
                results = await pipe.execute()
                if ops.outputs:
                    self._drop_moved(results[0])
                return
            except REDIS_LOST_ERRORS as exc:
                log.error("could not write a step's output (%s); retrying in %.1fs", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2.0, delay_s * 2)

    def _drop_moved(self, refused_streams) -> None:
        """Abort our copy of requests whose assignment another worker now holds (their chunks
        were refused): it continues from what the client has, and ours would only burn steps."""
        prefix = self.keys.output("")
        for stream in refused_streams or ():
            rid = (stream.decode() if isinstance(stream, bytes) else stream)[len(prefix):]
            if rid in self.active and rid not in self._moved:
                log.warning("request %s was moved to another worker; dropping our copy", rid)
                self._moved.add(rid)
                self.engine.submit(Abort(rid))

    def _queue_result(self, pipe, result: StepResult) -> None:
        wid = self.cfg.worker_id
        for out in result.outputs:
            act = self.active.get(out.request_id)
            if act is None:
                continue
            if not out.new_token_ids and not out.finished:
                continue
            chunk = OutputChunk(
                request_id=out.request_id, index=out.index + act.offset, token_ids=tuple(out.new_token_ids),
                finish_reason=out.finish_reason if out.finished else None,
                prompt_tokens=out.prompt_tokens - act.offset, completion_tokens=out.completion_tokens + act.offset,
                worker_id=wid)
            if out.finished:
                self._finish(pipe, out.request_id, act.entry_id, chunk)
                del self.active[out.request_id]
                self._moved.discard(out.request_id)
            else:
                self._write(pipe, chunk, first=act.chunks == 0)
                act.chunks += 1
        for request_id, why in result.rejected:
            act = self.active.pop(request_id, None)
            if act is not None:
                self._finish(pipe, request_id, act.entry_id, OutputChunk(request_id, act.offset, finish_reason="rejected", error=why,
                                                                         worker_id=wid))
        if result.stats is not None:
            stats = result.stats.replace(worker_id=wid)
            pipe.xadd(self.keys.stats, {b"s": stats.encode()}, maxlen=self.cfg.stats_maxlen, approximate=True)

    # ------------------------------------------------------------------ cancels

    async def _cancel_listener(self) -> None:
        while not self._closing:
            try:
                async with self.redis.pubsub() as ps:
                    await ps.subscribe(self.keys.cancel_channel)
                    while not self._closing:
                        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.5)
                        if not msg or msg.get("type") != "message":
                            continue
                        try:
                            rid = Cancel.decode(msg["data"]).request_id
                        except MessageError:
                            continue
                        if rid in self.active:
                            self.engine.submit(Abort(rid))
            except REDIS_LOST_ERRORS as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)

    async def _cancel_poll(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.cancel_poll_s)
            rids = list(self.active)
            if not rids:
                continue
            try:
                flags = await self.redis.mget([self.keys.cancel(r) for r in rids])
            except REDIS_LOST_ERRORS:
                continue
            for rid, flag in zip(rids, flags):
                if flag is not None and rid in self.active:
                    self.engine.submit(Abort(rid))

    # ------------------------------------------------------------------ heartbeat and policy

    def heartbeat(self) -> Heartbeat:
        snap = self.snapshot
        # Jobs handed to the engine thread but not yet in its counters are waiting too.
        unseen = max(0, len(self.active) - snap.running - snap.waiting)
        return Heartbeat(
            worker_id=self.cfg.worker_id, unix_ms=now_ms(), model=self.cfg.model_name,
            kv_blocks_free=snap.kv_blocks_free, kv_blocks_total=snap.kv_blocks_total, running=snap.running,
            waiting=snap.waiting + unseen, max_running=self.cfg.engine.max_running, gamma=snap.gamma,
            draft_residency=snap.draft_residency, policy_version=snap.policy_version, started_unix_ms=self.started_ms,
            memory_bytes=dict(snap.memory_bytes), draining=not self._accepting, engine_steps=snap.steps)

    async def _beat(self) -> None:
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.heartbeat(self.cfg.worker_id), self.heartbeat().encode(),
                         px=int(self.cfg.heartbeat_ttl_s * 1000))
                pipe.sadd(self.keys.workers, self.cfg.worker_id)
                await pipe.execute()
        except REDIS_LOST_ERRORS as exc:  # the reason only: a pipeline's message quotes the binary record
            log.warning("heartbeat failed (%s: %s)", type(exc).__name__, str(exc).split("caused error: ", 1)[-1])

    async def _heartbeat_loop(self) -> None:
        synced = time.monotonic()
        while not self._closing:
            await self._beat()
            if time.monotonic() - synced > CLOCK_SYNC_S:
                try:
                    await self.clock.sync(self.redis)
                    synced = time.monotonic()
                except REDIS_LOST_ERRORS:
                    pass
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    async def _policy_loop(self, stop: asyncio.Event) -> None:
        # The host holds the worker's only PolicyView (it may live in another process): this loop
        # only carries each policy read from Redis to it; the view keeps it if it is newer.
        self.engine.submit(FollowPolicy(self.cfg.worker_id, self.cfg.default_gamma, self.cfg.policy_ttl_s))
        await follow_policy(self.redis, self.keys, _ToHost(self.engine), stop)


class _ToHost:
    """follow_policy's sink in the worker: each policy read goes to the host's PolicyView."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def update(self, policy: Policy) -> None:
        self.host.submit(UpdatePolicy(policy))
