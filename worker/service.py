"""The worker service: Redis on one side (asyncio), the engine loop on the other (a thread, or on
CUDA a child process: worker/engine_proc.py).

- inbox: XREADGROUP on its own inbox stream; a job is acknowledged only once its final chunk
  is written (a worker killed mid-request leaves it pending; the scheduler re-dispatches it);
- outputs: every engine step's chunks go out in one pipelined round trip, with the step's
  stats (capped stream) and the bookkeeping of finished requests;
- cancels: pub/sub for speed, plus a periodic key check for messages missed while reconnecting;
- heartbeat: a Heartbeat with a TTL every ``heartbeat_interval_s``; the first is sent only once
  the models are loaded, so the stack is ready exactly when a worker can take work;
- policy: worker.policy_view follows the planner; each new version goes to the engine, which
  reads γ from its own view every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from nightjar import metrics as m
from nightjar.keys import Keys
from nightjar.messages import Cancel, DeadLetter, Heartbeat, Job, MessageError, OutputChunk
from nightjar.service_util import now_ms
from worker.engine_proc import EngineProcess
from worker.engine_thread import Abort, Add, EngineThread, FollowPolicy, SetResidency, Snapshot, StepResult, UpdatePolicy
from worker.service_config import WorkerServiceConfig

log = logging.getLogger("worker")
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024  # as the scheduler's dead letters

# Delete an assignment only if it is still ours: after a false death (a long pause) the
# scheduler may have given the job to another worker, whose record must survive us.
_RELEASE_ASSIGNMENT = """
if redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Every output chunk of a round trip in one command: one command for redis-py to pack and
# parse instead of one or two per chunk (those were most of the worker's event-loop CPU), and
# a script runs atomically, so the gateway's blocked XREAD wakes once with the whole step.
# KEYS: output streams. ARGV: the TTL in ms, then per key its chunk, then per key "1" if the
# stream's TTL must be (re)set (first and final chunk: a stream nobody reads must expire).
_WRITE_OUTPUTS = """
local n = #KEYS
for i = 1, n do
  redis.call('XADD', KEYS[i], '*', 'c', ARGV[1 + i])
  if ARGV[1 + n + i] == '1' then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return n
"""


class _Ops:
    """Records pipeline calls (xadd, pexpire, ...) so a failed round trip can be replayed.

    Output chunks go first, as one script call; inbox acknowledgements last, as one XACK and
    one XDEL: a job is never acknowledged before its final chunk (or its dead letter)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.outputs: list[tuple[str, bytes, bool]] = []  # (stream, chunk, set the TTL)
        self.acks: list[bytes] = []  # inbox entries whose job is done
        self.released: list[str] = []  # request ids leaving this worker's assignment set

    def __getattr__(self, name: str):
        return lambda *args, **kw: self.calls.append((name, args, kw))

    def __len__(self) -> int:
        return len(self.calls) + len(self.outputs) + len(self.acks) + len(self.released)

    def replay(self, pipe, keys: Keys, worker_id: str, output_ttl_ms: int) -> None:
        if self.outputs:
            streams = [o[0] for o in self.outputs]
            args = [output_ttl_ms, *(o[1] for o in self.outputs), *(b"1" if o[2] else b"0" for o in self.outputs)]
            pipe.eval(_WRITE_OUTPUTS, len(streams), *streams, *args)
        for name, args, kw in self.calls:  # stats, dead letters, assignment releases
            getattr(pipe, name)(*args, **kw)
        if self.acks:
            inbox = keys.inbox(worker_id)
            pipe.xack(inbox, keys.worker_group, *self.acks)
            pipe.xdel(inbox, *self.acks)
        if self.released:
            pipe.srem(keys.worker_assignments(worker_id), *self.released)


@dataclass
class Active:
    entry_id: bytes
    job: Job
    chunks: int = 0


class WorkerService:
    def __init__(self, cfg: WorkerServiceConfig, redis: aioredis.Redis, engine_factory=None) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.key_prefix)
        self.redis = redis
        self._injected = engine_factory  # tests hand in their own engines: those run in a thread
        self._factory = engine_factory or self._default_engine
        self._results: asyncio.Queue[StepResult] = asyncio.Queue()
        self.engine: EngineThread | EngineProcess | None = None
        self.active: dict[str, Active] = {}  # owned by the event loop
        self.snapshot = Snapshot()
        self.started_ms = now_ms()
        self._policy_version = -1
        self._accepting = True
        # Set before the tasks are cancelled at shutdown: every loop also checks it, because a
        # cancellation that lands inside a redis-py call can be lost (see gateway/output_reader.py).
        self._closing = False

    def _default_engine(self):
        from worker.engine import Engine

        return Engine(self.cfg.engine_config())

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        loop = asyncio.get_running_loop()
        deliver = lambda r: loop.call_soon_threadsafe(self._results.put_nowait, r)  # noqa: E731
        if self.cfg.use_engine_process and self._injected is None:
            self.engine = EngineProcess(self.cfg.engine_config(), deliver, log_level=self.cfg.log_level)
        else:
            self.engine = EngineThread(self._factory, deliver)
        self.engine.start()
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed to start: {self.engine.error}") from self.engine.error
        self.snapshot = self.engine.snapshot
        await self._ensure_group()
        log.info("worker %s ready (model %s, %d KV blocks)", self.cfg.worker_id, self.cfg.model_name, self.snapshot.kv_blocks_total)
        m.WORKER_READY.set(1)
        tasks = [asyncio.create_task(c) for c in (
            self._inbox_loop(stop), self._output_loop(), self._cancel_listener(), self._cancel_poll(),
            self._heartbeat_loop(), self._policy_loop(stop))]
        try:
            await stop.wait()
            if self.engine.error is None:
                await self._drain()
        finally:
            m.WORKER_READY.set(0)
            self._closing = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.engine.stop()
            try:  # leave at once instead of waiting for the heartbeat TTL
                await self.redis.delete(self.keys.heartbeat(self.cfg.worker_id))
            except RedisError:
                pass
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed: {self.engine.error}") from self.engine.error

    async def _drain(self) -> None:
        self._accepting = False
        deadline = time.monotonic() + self.cfg.drain_grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("stopping with %d requests unfinished; the scheduler re-dispatches them", len(self.active))

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.inbox(self.cfg.worker_id), self.keys.worker_group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

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
                if "NOGROUP" not in str(exc):
                    raise
                # The scheduler thought we were dead and removed our inbox; start a new one.
                log.warning("inbox was removed (declared dead after a pause?); recreating it")
                await self._ensure_group()
            except (RedisError, OSError) as exc:
                log.warning("inbox: Redis error (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def _accept(self, entries) -> None:
        if not self._accepting:  # draining: leave them pending; the scheduler re-sends them once we are gone
            return
        jobs: list[tuple[bytes, Job]] = []
        pipe = _Ops()
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
        now = now_ms()
        started = []
        for entry_id, job in jobs:
            if job.deadline_unix_ms and now >= job.deadline_unix_ms:
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
            self.active[job.request_id] = Active(entry_id, job)
            self.engine.submit(Add(job.request_id, list(job.prompt_token_ids), params))
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

    def _replay(self, ops: _Ops, pipe) -> None:
        ops.replay(pipe, self.keys, self.cfg.worker_id, int(self.cfg.output_ttl_s * 1000))

    def _dead_letter(self, pipe, entry_id: bytes, raw: bytes, reason: str) -> None:
        """Keep a malformed entry (truncated) where `nightjar queue dlq` shows it, then drop it."""
        dl = DeadLetter(entry_id=entry_id.decode(), reason=f"worker {self.cfg.worker_id} inbox: {reason}", deliveries=1,
                        payload=bytes(raw[:DEAD_LETTER_PAYLOAD_BYTES]), unix_ms=now_ms())
        pipe.xadd(self.keys.dead_letters, {b"dl": dl.encode()}, maxlen=10_000, approximate=True)
        self._ack(pipe, entry_id)

    def _ack(self, pipe: _Ops, entry_id: bytes) -> None:
        pipe.acks.append(entry_id)  # XACK + XDEL, after the round trip's output chunks

    def _finish(self, pipe: _Ops, request_id: str, entry_id: bytes, final: OutputChunk) -> None:
        """Write the final chunk, then acknowledge and forget the job (same round trip, in order)."""
        self._write(pipe, final, first=True)
        self._ack(pipe, entry_id)
        pipe.released.append(request_id)
        pipe.eval(_RELEASE_ASSIGNMENT, 1, self.keys.assignment(request_id), self.cfg.worker_id)

    def _write(self, pipe: _Ops, chunk: OutputChunk, first: bool) -> None:
        # A stream nobody reads must not outlive its TTL: set on the first and the final chunk.
        pipe.outputs.append((self.keys.output(chunk.request_id), chunk.encode(), first or chunk.finish_reason is not None))

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
            ops = _Ops()
            for result in results:
                self._queue_result(ops, result)
            if results[-1].snapshot.draft_residency != self.snapshot.draft_residency:
                m.set_residency(results[-1].snapshot.draft_residency)
            self.snapshot = results[-1].snapshot
            await self._write_until_done(ops)
            for result in results:
                if result.stats is not None:
                    m.observe_step(result.stats)
            snap = self.snapshot
            m.observe_engine_state(snap.running, snap.waiting, snap.kv_blocks_free, snap.kv_blocks_total)

    async def _write_until_done(self, ops: "_Ops") -> None:
        """One round trip for a batch of steps, retried until Redis takes it: a dropped chunk
        would leave a gap in a client's stream, a dropped final record a client waiting forever.
        Every op is idempotent or deduplicated by index, so replaying a partial write is safe."""
        delay_s = 0.1
        while len(ops):
            pipe = self.redis.pipeline(transaction=False)
            self._replay(ops, pipe)
            try:
                await pipe.execute()
                return
            except (RedisError, OSError) as exc:
                log.error("could not write a step's output (%s); retrying in %.1fs", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2.0, delay_s * 2)

    def _queue_result(self, pipe, result: StepResult) -> None:
        wid = self.cfg.worker_id
        for out in result.outputs:
            act = self.active.get(out.request_id)
            if act is None:
                continue
            if not out.new_token_ids and not out.finished:
                continue
            chunk = OutputChunk(
                request_id=out.request_id, index=out.index, token_ids=tuple(out.new_token_ids),
                finish_reason=out.finish_reason if out.finished else None,
                prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens, worker_id=wid)
            if out.finished:
                self._finish(pipe, out.request_id, act.entry_id, chunk)
                del self.active[out.request_id]
            else:
                self._write(pipe, chunk, first=act.chunks == 0)
                act.chunks += 1
        for request_id, why in result.rejected:
            act = self.active.pop(request_id, None)
            if act is not None:
                self._finish(pipe, request_id, act.entry_id, OutputChunk(request_id, 0, finish_reason="rejected", error=why, worker_id=wid))
        if result.stats is not None:
            stats = dataclasses.replace(result.stats, worker_id=wid)
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
            except (RedisError, OSError) as exc:
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
            except (RedisError, OSError):
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
            waiting=snap.waiting + unseen, max_running=self.cfg.max_running, gamma=snap.gamma,
            draft_residency=snap.draft_residency, policy_version=self._policy_version, started_unix_ms=self.started_ms,
            memory_bytes=dict(snap.memory_bytes))

    async def _heartbeat_loop(self) -> None:
        ttl_ms = int(self.cfg.heartbeat_ttl_s * 1000)
        while not self._closing:
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.set(self.keys.heartbeat(self.cfg.worker_id), self.heartbeat().encode(), px=ttl_ms)
                    pipe.sadd(self.keys.workers, self.cfg.worker_id)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed (%s)", exc)
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    async def _policy_loop(self, stop: asyncio.Event) -> None:
        try:
            from worker.policy_view import PolicyView, follow_policy
        except ImportError:  # the planner's view is not installed: the engine keeps default γ
            log.warning("worker.policy_view missing: running with default gamma %d", self.cfg.default_gamma)
            return
        # The engine keeps a view of its own (it may live in another process); this one decides
        # residency and forwards each new policy.
        view = PolicyView(self.cfg.worker_id, self.cfg.default_gamma, self.cfg.policy_ttl_s)
        self.engine.submit(FollowPolicy(self.cfg.worker_id, self.cfg.default_gamma, self.cfg.policy_ttl_s))
        follower = asyncio.create_task(follow_policy(self.redis, self.keys, view, stop))
        residency = None
        try:
            while not follower.done():
                wanted = view.residency(time.time())
                if wanted and wanted != residency and self.cfg.draft_path is not None:
                    self.engine.submit(SetResidency(wanted))
                    residency = wanted
                if view.version != self._policy_version and view.policy is not None:
                    self.engine.submit(UpdatePolicy(view.policy))
                    m.observe_policy(view.policy)
                self._policy_version = view.version
                await asyncio.sleep(0.1)
        finally:
            follower.cancel()
