"""Direct dispatch under the scheduler's lease table, against a real redis-server.

Workers are the heartbeat records they would publish (as in test_scheduler_service.py); the
scheduler that writes the table and re-dispatches is the real one.
"""

from __future__ import annotations

import pytest

from nightjar.dispatch_lease import DirectDispatch
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, Job
from nightjar.service_util import connect_redis, now_ms
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.dispatcher import Dispatcher


@pytest.fixture
async def env(redis_url, key_prefix):
    redis = connect_redis(redis_url)
    sched = Dispatcher(SchedulerConfig(redis_url=redis_url, key_prefix=key_prefix, consumer="s1"), redis)
    await sched.ensure_group()
    keys = Keys(key_prefix)
    yield sched, DirectDispatch(redis, keys, assignment_ttl_s=60.0), redis, keys
    found = [k async for k in redis.scan_iter(match=f"{key_prefix}:*")]
    if found:
        await redis.delete(*found)
    await redis.aclose()


async def beat(redis, keys, wid, kv_free=100, running=0, draining=False):
    hb = Heartbeat(worker_id=wid, unix_ms=now_ms(), model="m", kv_blocks_free=kv_free, kv_blocks_total=100,
                   running=running, waiting=0, max_running=8, gamma=0, draft_residency="none", draining=draining)
    await redis.set(keys.heartbeat(wid), hb.encode(), px=60_000)
    await redis.sadd(keys.workers, wid)


async def send(direct, rid) -> str | None:
    raw = Job(request_id=rid, prompt_token_ids=(1, 2, 3), params={"max_tokens": 4}).encode()
    return await direct.enqueue(rid, raw, now_ms())


async def inbox_ids(redis, keys, wid) -> list[str]:
    return [Job.decode(f[b"job"]).request_id for _, f in await redis.xrange(keys.inbox(wid))]


async def test_without_a_scheduler_jobs_wait_on_the_requests_stream(env):
    _sched, direct, redis, keys = env
    await beat(redis, keys, "w1")  # a live worker, but nobody published a lease table
    assert await send(direct, "r0") is None
    assert await redis.xlen(keys.requests) == 1
    assert await inbox_ids(redis, keys, "w1") == [] and not await redis.exists(keys.assignment("r0"))


async def test_leased_job_lands_in_the_inbox_with_the_schedulers_records(env):
    sched, direct, redis, keys = env
    await beat(redis, keys, "w1")
    await sched.refresh_workers()
    assert 0 < await redis.pttl(keys.leases) <= sched.cfg.lease_ttl_s * 1000
    assert await send(direct, "r0") == "w1"
    assert await inbox_ids(redis, keys, "w1") == ["r0"]
    record = await redis.hgetall(keys.assignment("r0"))
    assert record[b"worker"] == b"w1" and Job.decode(record[b"job"]).request_id == "r0"
    assert 0 < await redis.pttl(keys.assignment("r0")) <= 60_000
    assert await redis.smembers(keys.worker_assignments("w1")) == {b"r0"}
    assert await redis.xlen(keys.requests) == 0


async def test_picks_the_freest_worker_counting_assignments_live(env):
    sched, direct, redis, keys = env
    await beat(redis, keys, "w1")
    await beat(redis, keys, "w2")
    await sched.refresh_workers()
    # Equal heartbeats: ties go to the larger id, then each lease makes that worker less free
    # until the next table, so the jobs alternate instead of piling onto one worker.
    assert [await send(direct, f"r{i}") for i in range(4)] == ["w2", "w1", "w2", "w1"]
    await beat(redis, keys, "w2", kv_free=10)  # w2's KV is nearly full: w1 takes the next jobs
    await sched.refresh_workers()
    assert [await send(direct, f"s{i}") for i in range(3)] == ["w1", "w1", "w1"]


async def test_waiting_jobs_go_first_and_dead_workers_are_skipped(env):
    sched, direct, redis, keys = env
    await beat(redis, keys, "w1")
    await beat(redis, keys, "w2")
    await sched.refresh_workers()
    await redis.delete(keys.heartbeat("w2"))  # died since the table was written
    assert [await send(direct, f"r{i}") for i in range(2)] == ["w1", "w1"]
    await redis.xadd(keys.requests, {b"job": b"queued before"})  # a backlog: no overtaking it
    assert await send(direct, "r2") is None
    assert await redis.xlen(keys.requests) == 2
    await redis.delete(keys.requests, keys.heartbeat("w1"))
    assert await send(direct, "r3") is None  # nobody in the table is alive


async def test_a_leased_job_of_a_dead_worker_is_redispatched(env):
    sched, direct, redis, keys = env
    await beat(redis, keys, "w1")
    await sched.refresh_workers()
    assert await send(direct, "r0") == "w1"
    await redis.delete(keys.heartbeat("w1"))
    await beat(redis, keys, "w2")
    dead = await sched.refresh_workers()
    assert dead == ["w1"] and await redis.hkeys(keys.leases) == [b"w2"]
    await sched.redispatch("w1")
    moved = await redis.xrange(keys.inbox("w2"))
    assert [Job.decode(f[b"job"]).attempt for _, f in moved] == [1]
    assert await redis.hget(keys.assignment("r0"), "worker") == b"w2"


async def test_a_draining_worker_gets_nothing_new_even_from_a_table_written_before_it_drained(env):
    sched, direct, redis, keys = env
    await beat(redis, keys, "idle-but-draining")
    await beat(redis, keys, "busy", kv_free=40, running=6)
    await sched.refresh_workers()  # the table still lists both
    await beat(redis, keys, "idle-but-draining", draining=True)  # SIGTERM after the table was written
    assert [await send(direct, f"r{i}") for i in range(3)] == ["busy"] * 3
    await sched.refresh_workers()  # the scheduler leaves it out of the next table
    assert set(await redis.hkeys(keys.leases)) == {b"busy"}
    await beat(redis, keys, "busy", draining=True)
    await sched.refresh_workers()
    assert await send(direct, "queued") is None and await redis.xlen(keys.requests) == 1
