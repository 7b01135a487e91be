"""The worker service in this process (real engine, in a thread or in a child process; real
redis-server); the test plays the scheduler (XADD to the inbox) and the gateway (reads the
output stream, publishes cancels)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from nightjar.keys import Keys
from nightjar.messages import Cancel, Heartbeat, Job, OutputChunk, Policy, SamplingParams, StepStats
from nightjar.service_util import connect_redis, now_ms
from tests.conftest import engine, pair, prompt_ids, read_until_final, run_all
from worker.engine.config import EngineConfig
from worker.service.config import WorkerServiceConfig
from worker.service.loops import WorkerService

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
async def svc(redis_server, request):
    target, draft = pair()
    cfg = WorkerServiceConfig(redis_url=redis_server.url, key_prefix=f"w{uuid.uuid4().hex[:8]}", worker_id="w1",
                              engine=EngineConfig(target_path=str(target), draft_path=str(draft), default_gamma=2, num_threads=1),
                              heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0, cancel_poll_s=0.2,
                              engine_process=request.param)
    redis = connect_redis(cfg.redis_url)
    service = WorkerService(cfg, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    keys = Keys(cfg.key_prefix)
    for _ in range(600):  # the first heartbeat comes once the models are loaded
        if await redis.exists(keys.heartbeat("w1")):
            break
        await asyncio.sleep(0.1)
    yield service, redis, keys
    stop.set()
    await task
    await redis.aclose()


async def submit(redis, keys, rid, ids, worker="w1", **params) -> None:
    job = Job(request_id=rid, prompt_token_ids=tuple(ids), params=params, enqueued_unix_ms=now_ms())
    await redis.hset(keys.assignment(rid), mapping={"worker": worker, "job": job.encode()})
    await redis.sadd(keys.worker_assignments("w1"), rid)
    await redis.xadd(keys.inbox("w1"), {b"job": job.encode()})


async def test_job_streams_indexed_chunks_then_is_acked_and_released(svc):
    service, redis, keys = svc
    target, _ = pair()
    ids = list(prompt_ids(target, 1)[0])
    from worker.engine.engine import EngineRequest

    ref = run_all(engine(target), [EngineRequest("ref", ids, SamplingParams(max_tokens=12))])["ref"]
    await submit(redis, keys, "job1", ids, max_tokens=12)
    chunks = await read_until_final(redis, keys, "job1")
    got = []
    for c in chunks:
        assert c.index == len(got) and c.worker_id == "w1"  # contiguous, no gaps or repeats
        got += c.token_ids
    assert got == ref
    final = chunks[-1]
    assert final.finish_reason in ("length", "stop") and final.completion_tokens == len(got)
    assert 0 < await redis.pttl(keys.output("job1")) <= 600_000
    await asyncio.sleep(0.05)
    assert await redis.xlen(keys.inbox("w1")) == 0  # acknowledged and deleted after the final chunk
    assert (await redis.xpending(keys.inbox("w1"), keys.worker_group))["pending"] == 0
    assert not await redis.exists(keys.assignment("job1"))
    assert not await redis.sismember(keys.worker_assignments("w1"), "job1")
    (_, fields), *_ = await redis.xrevrange(keys.stats, count=1)
    stats = StepStats.decode(fields[b"s"])
    assert stats.worker_id == "w1" and stats.gamma == 2  # default γ (no planner)
    hb = Heartbeat.decode(await redis.get(keys.heartbeat("w1")))
    assert hb.model == Path(target).name and hb.kv_blocks_total > 0 and await redis.sismember(keys.workers, "w1")
    for _ in range(20):  # the beat read above may predate the job (one every 0.2 s)
        if hb.engine_steps > 0:
            break
        await asyncio.sleep(0.1)
        hb = Heartbeat.decode(await redis.get(keys.heartbeat("w1")))
    assert hb.engine_steps > 0 and not hb.draining  # the scheduler's proof of progress, in both engine modes


async def test_refused_expired_and_cancelled_jobs_get_a_final_chunk_without_running(svc):
    service, redis, keys = svc
    await submit(redis, keys, "huge", [1, 2, 10**7], max_tokens=4)  # a token id outside the vocabulary
    await redis.set(keys.cancel("gone"), "cancelled")
    await submit(redis, keys, "gone", [1, 2, 3], max_tokens=4)
    job = Job(request_id="late", prompt_token_ids=(1, 2), params={"max_tokens": 4}, deadline_unix_ms=now_ms() - 1)
    await redis.xadd(keys.inbox("w1"), {b"job": job.encode()})
    assert (await read_until_final(redis, keys, "huge"))[-1].finish_reason == "rejected"
    assert (await read_until_final(redis, keys, "gone"))[-1].finish_reason == "abort"
    assert (await read_until_final(redis, keys, "late"))[-1].finish_reason == "deadline"
    assert service.active == {}


async def test_cancel_on_the_channel_aborts_within_a_step_and_frees_blocks(svc):
    service, redis, keys = svc
    free_before = service.snapshot.kv_blocks_free
    await submit(redis, keys, "long", [5, 6, 7, 8], max_tokens=500, ignore_eos=True)
    last = b"0-0"
    while True:  # wait for the first tokens
        reply = await redis.xread({keys.output("long"): last}, block=5000)
        if reply:
            break
    assert service.snapshot.kv_blocks_free < free_before or service.active
    await redis.publish(keys.cancel_channel, Cancel("long").encode())
    chunks = await read_until_final(redis, keys, "long", timeout_s=5)
    assert chunks[-1].finish_reason == "abort" and chunks[-1].completion_tokens < 500
    for _ in range(20):
        if service.snapshot.kv_blocks_free == free_before:
            break
        await asyncio.sleep(0.05)
    assert service.snapshot.kv_blocks_free == free_before


async def test_an_assignment_moved_to_another_worker_gets_no_output_from_the_old_one(svc):
    service, redis, keys = svc
    await submit(redis, keys, "moved", [1, 2, 3], worker="w2", max_tokens=40, ignore_eos=True)  # given to w2 meanwhile
    for _ in range(100):  # it drops its copy as soon as its first chunk is refused
        if "moved" not in service.active:
            break
        await asyncio.sleep(0.05)
    assert "moved" not in service.active
    # Nothing of ours in the stream: w2 continues from what it holds (a sampled request would
    # otherwise splice two samples), and the assignment is not released by us.
    assert await redis.xlen(keys.output("moved")) == 0
    assert await redis.hget(keys.assignment("moved"), "worker") == b"w2"


async def test_a_redispatched_job_continues_from_what_the_client_was_sent(svc):
    service, redis, keys = svc
    target, _ = pair()
    ids = list(prompt_ids(target, 2)[1])
    from worker.engine.engine import EngineRequest

    ref = run_all(engine(target), [EngineRequest("ref", ids, SamplingParams(max_tokens=16, ignore_eos=True))])["ref"]
    # A dead worker delivered 5 tokens (once twice, as after an earlier re-run) and died.
    for index, toks in ((0, ref[:3]), (0, ref[:2]), (3, ref[3:5])):
        await redis.xadd(keys.output("resumed"), {b"c": OutputChunk("resumed", index, tuple(toks), worker_id="dead").encode()})
    job = Job(request_id="resumed", prompt_token_ids=tuple(ids), params={"max_tokens": 16, "ignore_eos": True}, attempt=1)
    await redis.hset(keys.assignment("resumed"), mapping={"worker": "w1", "job": job.encode()})
    await redis.xadd(keys.inbox("w1"), {b"job": job.encode()})
    ours = [c for c in await read_until_final(redis, keys, "resumed") if c.worker_id == "w1"]
    assert ours[0].index == 5  # not 0: the client has 0..4
    got = list(ref[:5])
    for c in ours:
        assert c.index == len(got)
        got += c.token_ids
    assert got == ref  # greedy: the same as an uninterrupted run
    assert ours[-1].completion_tokens == 16 and ours[-1].prompt_tokens == len(ids)


async def test_a_policy_with_an_unknown_residency_is_ignored_not_fatal(svc):
    service, redis, keys = svc
    bogus = Policy(version=10**6, unix_ms=now_ms(), ttl_s=10.0, bucket_upper_bounds=(1,), gamma_by_bucket=(1,),
                   residency={"w1": "evaporated"}, epoch="bogus")
    await redis.set(keys.policy, bogus.encode())
    await redis.publish(keys.policy_channel, bogus.encode())
    for _ in range(50):  # adopted (γ from it), its residency ignored
        if Heartbeat.decode(await redis.get(keys.heartbeat("w1"))).policy_version == 10**6:
            break
        await asyncio.sleep(0.1)
    assert Heartbeat.decode(await redis.get(keys.heartbeat("w1"))).policy_version == 10**6
    await submit(redis, keys, "after-bogus", [1, 2, 3], max_tokens=3)
    assert (await read_until_final(redis, keys, "after-bogus"))[-1].finish_reason in ("length", "stop")
    assert service.engine.error is None and service.snapshot.draft_residency == "resident"
    await redis.delete(keys.policy)
