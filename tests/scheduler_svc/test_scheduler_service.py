"""The scheduler against a real redis-server: dispatch, dead letters, deadlines, reclaim, re-dispatch.

Workers are represented by the heartbeat records they would publish (hand-built data, as
vLLM's scheduler tests hand-build outputs); everything else is the real Dispatcher on Redis.
"""

from __future__ import annotations

import asyncio

import pytest

from nightjar.keys import Keys
from nightjar.messages import DeadLetter, Heartbeat, Job, OutputChunk
from nightjar.service_util import connect_redis, now_ms
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.dispatcher import Dispatcher


@pytest.fixture
async def env(redis_url, key_prefix):
    redis = connect_redis(redis_url)
    cfg = SchedulerConfig(redis_url=redis_url, key_prefix=key_prefix, consumer="s1", claim_idle_ms=50,
                          max_deliveries=2, read_block_ms=100)
    sched = Dispatcher(cfg, redis)
    await sched.ensure_group()
    yield sched, redis, Keys(key_prefix)
    keys = [k async for k in redis.scan_iter(match=f"{key_prefix}:*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


async def beat(redis, keys, wid, free=100, running=0, ttl_ms=60_000, draining=False):
    hb = Heartbeat(worker_id=wid, unix_ms=now_ms(), model="m", kv_blocks_free=free, kv_blocks_total=100,
                   running=running, waiting=0, max_running=8, gamma=0, draft_residency="none", draining=draining)
    await redis.set(keys.heartbeat(wid), hb.encode(), px=ttl_ms)
    await redis.sadd(keys.workers, wid)


def job(rid, **kw) -> Job:
    return Job(request_id=rid, prompt_token_ids=(1, 2, 3), params={"max_tokens": 4}, **kw)


async def read_group(sched, redis, keys):
    reply = await redis.xreadgroup(keys.scheduler_group, sched.cfg.consumer, {keys.requests: ">"}, count=100)
    return reply[0][1] if reply else []


async def inbox_jobs(redis, keys, wid) -> list[Job]:
    return [Job.decode(f[b"job"]) for _, f in await redis.xrange(keys.inbox(wid))]


async def test_dispatch_to_freest_worker_records_assignment_and_acks(env):
    sched, redis, keys = env
    await beat(redis, keys, "busy", running=6)
    await beat(redis, keys, "idle", running=0)
    await sched.refresh_workers()
    for i in range(4):
        await redis.xadd(keys.requests, {b"job": job(f"r{i}").encode()})
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    idle, busy = await inbox_jobs(redis, keys, "idle"), await inbox_jobs(redis, keys, "busy")
    # busy has 2 of 8 slots free (0.25), idle 8 of 8: idle stays freer through 4 assignments (0.5)
    assert [j.request_id for j in idle] == ["r0", "r1", "r2", "r3"] and busy == []
    assert await redis.hget(keys.assignment("r0"), "worker") == b"idle"
    assert await redis.smembers(keys.worker_assignments("idle")) == {b"r0", b"r1", b"r2", b"r3"}
    assert (await redis.xpending(keys.requests, keys.scheduler_group))["pending"] == 0
    assert await redis.xlen(keys.requests) == 0  # dispatched entries are deleted: XLEN = backlog


async def test_a_draining_worker_gets_no_jobs_and_is_not_declared_dead(env):
    sched, redis, keys = env
    await beat(redis, keys, "leaving", draining=True)
    await beat(redis, keys, "busy", running=7)
    assert await sched.refresh_workers() == []
    for i in range(3):
        await redis.xadd(keys.requests, {b"job": job(f"r{i}").encode()})
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    assert await inbox_jobs(redis, keys, "leaving") == [] and len(await inbox_jobs(redis, keys, "busy")) == 3


async def test_undecodable_entry_is_dead_lettered(env):
    sched, redis, keys = env
    await beat(redis, keys, "w")
    await sched.refresh_workers()
    await redis.xadd(keys.requests, {b"job": b"\xc1not msgpack"})
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    (_, fields), = await redis.xrange(keys.dead_letters)
    dl = DeadLetter.decode(fields[b"dl"])
    assert "not valid msgpack" in dl.reason and dl.payload.startswith(b"\xc1")
    assert (await redis.xpending(keys.requests, keys.scheduler_group))["pending"] == 0


async def test_expired_deadline_finishes_with_an_error_chunk(env):
    sched, redis, keys = env
    await beat(redis, keys, "w")
    await sched.refresh_workers()
    await redis.xadd(keys.requests, {b"job": job("late", deadline_unix_ms=now_ms() - 1).encode()})
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    (_, fields), = await redis.xrange(keys.output("late"))
    assert OutputChunk.decode(fields[b"c"]).finish_reason == "deadline"
    assert await inbox_jobs(redis, keys, "w") == []
    assert await redis.pttl(keys.output("late")) > 0


async def test_no_worker_parks_the_job_until_one_heartbeats(env):
    sched, redis, keys = env
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))
    try:
        await redis.xadd(keys.requests, {b"job": job("wait").encode()})
        await asyncio.sleep(0.4)
        assert (await redis.xpending(keys.requests, keys.scheduler_group))["pending"] == 1  # not acked
        await beat(redis, keys, "late-worker")
        for _ in range(50):
            if await inbox_jobs(redis, keys, "late-worker"):
                break
            await asyncio.sleep(0.05)
        assert [j.request_id for j in await inbox_jobs(redis, keys, "late-worker")] == ["wait"]
        assert (await redis.xpending(keys.requests, keys.scheduler_group))["pending"] == 0
    finally:
        stop.set()
        await task


async def test_reclaims_a_dead_schedulers_pending_entries_and_dead_letters_poison(env):
    sched, redis, keys = env
    await beat(redis, keys, "w")
    await sched.refresh_workers()
    await redis.xadd(keys.requests, {b"job": job("orphan").encode()})
    await redis.xadd(keys.requests, {b"job": job("poison").encode()})
    # A scheduler "dead" reads both and never acks; the poison one was delivered twice already.
    await redis.xreadgroup(keys.scheduler_group, "dead", {keys.requests: ">"}, count=1)
    await redis.xreadgroup(keys.scheduler_group, "dead", {keys.requests: ">"}, count=1)
    poison_id = (await redis.xrange(keys.requests))[1][0]
    await redis.xclaim(keys.requests, keys.scheduler_group, "dead2", 0, [poison_id])  # delivery 2
    await asyncio.sleep(0.1)  # past claim_idle_ms
    assert await sched.reclaim() == 2  # XAUTOCLAIM: delivery 2 for orphan, 3 (> max 2) for poison
    assert [j.request_id for j in await inbox_jobs(redis, keys, "w")] == ["orphan"]
    (_, fields), = await redis.xrange(keys.dead_letters)
    assert DeadLetter.decode(fields[b"dl"]).deliveries == 3
    (_, out), = await redis.xrange(keys.output("poison"))
    assert OutputChunk.decode(out[b"c"]).finish_reason == "error"  # its client still gets an answer
    assert (await redis.xpending(keys.requests, keys.scheduler_group))["pending"] == 0


async def test_dead_workers_jobs_go_to_a_live_worker_with_attempt_plus_one(env):
    sched, redis, keys = env
    await beat(redis, keys, "doomed", ttl_ms=150)
    await sched.refresh_workers()
    await redis.xadd(keys.requests, {b"job": job("a").encode()})
    await redis.xadd(keys.requests, {b"job": job("b", attempt=2).encode()})  # already failed twice
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    assert len(await inbox_jobs(redis, keys, "doomed")) == 2
    await beat(redis, keys, "heir")
    await asyncio.sleep(0.2)  # doomed's heartbeat expires
    dead = await sched.refresh_workers()
    assert dead == ["doomed"]
    await sched.redispatch("doomed")
    moved = await inbox_jobs(redis, keys, "heir")
    assert [(j.request_id, j.attempt) for j in moved] == [("a", 1)]
    assert await redis.hget(keys.assignment("a"), "worker") == b"heir"
    (_, out), = await redis.xrange(keys.output("b"))  # max_attempts=3 reached: error, not a 4th run
    assert OutputChunk.decode(out[b"c"]).finish_reason == "error"
    assert not await redis.exists(keys.inbox("doomed"), keys.worker_assignments("doomed"))
    assert await redis.smembers(keys.workers) == {b"heir"}


async def test_forgetting_a_dead_worker_keeps_a_job_that_reached_its_inbox_meanwhile(env):
    """The dispatch loop can still pick a worker the watch loop has just found dead (its view is
    one check old): such a job must stay where the worker, heartbeating again, will read it."""
    sched, redis, keys = env
    await beat(redis, keys, "back")
    await sched.refresh_workers()
    async with redis.pipeline(transaction=True) as pipe:
        sched._assign(pipe, job("late"), "back", now_ms())
        await pipe.execute()
    assert not await sched.forget("back")
    assert [j.request_id for j in await inbox_jobs(redis, keys, "back")] == ["late"]
    assert await redis.sismember(keys.workers, "back")
    await redis.srem(keys.worker_assignments("back"), "late")  # finished
    assert await sched.forget("back")
    assert not await redis.exists(keys.inbox("back")) and not await redis.sismember(keys.workers, "back")


async def test_the_deadline_budget_counts_the_time_in_the_queue(env):
    sched, redis, keys = env
    await sched.clock.sync(redis)
    await beat(redis, keys, "w")
    await sched.refresh_workers()
    await redis.xadd(keys.requests, {b"job": job("short", deadline_budget_ms=150).encode()})
    await redis.xadd(keys.requests, {b"job": job("long", deadline_budget_ms=60_000).encode()})
    await asyncio.sleep(0.3)  # both waited 300 ms on Redis' clock before the scheduler read them
    await sched.handle(await read_group(sched, redis, keys), deliveries=1)
    (_, fields), = await redis.xrange(keys.output("short"))
    assert OutputChunk.decode(fields[b"c"]).finish_reason == "deadline"
    (forwarded,) = await inbox_jobs(redis, keys, "w")
    # The inbox entry counts from its own id: it carries what is left, not the full budget again.
    assert forwarded.request_id == "long" and 50_000 < forwarded.deadline_budget_ms <= 59_700


async def test_a_bad_assignment_record_is_dead_lettered_and_the_watch_loop_goes_on(env):
    sched, redis, keys = env
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))
    try:
        await beat(redis, keys, "heir")
        await redis.hset(keys.assignment("bad"), mapping={b"worker": b"gone1", b"job": b"\xc1 not a job"})
        await redis.sadd(keys.worker_assignments("gone1"), "bad")
        await redis.sadd(keys.workers, "gone1")
        for _ in range(40):
            if await redis.xlen(keys.dead_letters):
                break
            await asyncio.sleep(0.05)
        # Another worker dies after that: the watch loop must still be there to notice.
        await redis.hset(keys.assignment("good"), mapping={b"worker": b"gone2", b"job": job("good").encode()})
        await redis.sadd(keys.worker_assignments("gone2"), "good")
        await redis.sadd(keys.workers, "gone2")
        for _ in range(40):
            if await inbox_jobs(redis, keys, "heir"):
                break
            await asyncio.sleep(0.05)
        assert [j.request_id for j in await inbox_jobs(redis, keys, "heir")] == ["good"]
        (_, fields), = await redis.xrange(keys.dead_letters)
        assert "gone1" in DeadLetter.decode(fields[b"dl"]).reason
        (_, out), = await redis.xrange(keys.output("bad"))
        assert OutputChunk.decode(out[b"c"]).finish_reason == "error"  # its client is answered
        assert not await redis.exists(keys.assignment("bad"))
        assert all(not t.done() for t in asyncio.all_tasks() if t.get_name().endswith("_loop"))
    finally:
        stop.set()
        await task
