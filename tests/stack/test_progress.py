"""Alive means making progress. A worker with work whose engine takes no step is stalled: the
scheduler leaves it out of dispatch and re-dispatches its jobs (its heartbeat, sent by the event
loop, would otherwise keep them waiting forever). A worker whose Redis is busy running a script
(BUSY errors) keeps its inbox loop and recovers when the script is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis as sync_redis

from nightjar.keys import Keys
from nightjar.messages import Heartbeat, Job
from nightjar.service_util import connect_redis, now_ms
from nightjar.v1 import inference_pb2 as pb
from nightjar_tools.redis_server import EmbeddedRedis
from scheduler_svc.capacity import ProgressView
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.dispatcher import Dispatcher
from tests.conftest import pair
from tests.stack.conftest import (
    aio_stub,
    assert_same_greedy,
    engine_reference,
    heartbeats,
    prompt_texts,
    read_until_final,
    start_stack,
)
from worker.engine.config import EngineConfig
from worker.service.config import WorkerServiceConfig
from worker.service.loops import WorkerService


def hb(wid: str, steps: int, running: int = 2) -> Heartbeat:
    return Heartbeat(worker_id=wid, unix_ms=now_ms(), model="m", kv_blocks_free=90, kv_blocks_total=100,
                     running=running, waiting=0, max_running=8, gamma=0, draft_residency="none", engine_steps=steps)


def test_progress_view_stalled_only_with_work_and_no_steps():
    view = ProgressView(stall_s=3.0)
    assert view.stalled({"a": hb("a", 5), "idle": hb("idle", 9, running=0)}, 0.0) == set()
    assert view.stalled({"a": hb("a", 5), "idle": hb("idle", 9, running=0)}, 2.9) == set()
    assert view.stalled({"a": hb("a", 5), "idle": hb("idle", 9, running=0)}, 10.0) == {"a"}  # idle is not stuck
    assert view.stalled({"a": hb("a", 6)}, 10.1) == set()  # it moved: the clock starts again
    assert view.stalled({"a": hb("a", 6)}, 12.0) == set() and view.stalled({"a": hb("a", 6)}, 13.2) == {"a"}


async def test_a_stalled_worker_is_left_out_and_its_jobs_go_elsewhere(redis_url, key_prefix):
    redis = connect_redis(redis_url)
    keys = Keys(key_prefix)
    sched = Dispatcher(SchedulerConfig(redis_url=redis_url, key_prefix=key_prefix, consumer="s1", stall_s=0.3), redis)
    await sched.ensure_group()
    try:
        for wid, steps in (("stuck", 40), ("fine", 7)):
            await redis.set(keys.heartbeat(wid), hb(wid, steps, running=2 if wid == "stuck" else 0).encode(), px=60_000)
            await redis.sadd(keys.workers, wid)
        job = Job("r1", (1, 2, 3), {"max_tokens": 4})
        await redis.hset(keys.assignment("r1"), mapping={b"worker": b"stuck", b"job": job.encode()})
        await redis.sadd(keys.worker_assignments("stuck"), "r1")
        assert await sched.refresh_workers() == []
        await asyncio.sleep(0.35)  # "stuck" heartbeats on, the same step count, work in hand
        assert await sched.refresh_workers() == ["stuck"]
        assert set(await redis.hkeys(keys.leases)) == {b"fine"} and sched.capacity.pick() == "fine"
        assert await sched.redispatch("stuck")
        (_, fields), = await redis.xrange(keys.inbox("fine"))
        assert Job.decode(fields[b"job"]).request_id == "r1"
        sched._stall_handled.add("stuck")
        assert await sched.refresh_workers() == []  # handled once, not on every check
        await redis.set(keys.heartbeat("stuck"), hb("stuck", 41).encode(), px=60_000)  # moving again
        await redis.sadd(keys.workers, "stuck")  # (its heartbeat re-registers it: it was forgotten)
        await sched.refresh_workers()
        assert set(await redis.hkeys(keys.leases)) == {b"fine", b"stuck"}
    finally:
        found = [k async for k in redis.scan_iter(match=f"{key_prefix}:*")]
        if found:
            await redis.delete(*found)
        await redis.aclose()


@pytest.mark.slow
async def test_the_worker_survives_redis_busy_with_a_script_and_recovers():
    server = EmbeddedRedis().start()
    admin = sync_redis.Redis.from_url(server.url)
    admin.config_set("lua-time-limit", 100)  # BUSY replies after 0.1 s of script, not 5 s
    target, draft = pair()
    cfg = WorkerServiceConfig(redis_url=server.url, key_prefix=f"b{uuid.uuid4().hex[:6]}", worker_id="wb",
                              engine=EngineConfig(target_path=str(target), draft_path=str(draft), num_threads=1),
                              heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0, cancel_poll_s=0.2)
    keys = Keys(cfg.key_prefix)
    redis = connect_redis(cfg.redis_url)
    service = WorkerService(cfg, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        for _ in range(600):
            if await redis.exists(keys.heartbeat("wb")):
                break
            await asyncio.sleep(0.1)

        async def submit(rid):
            job = Job(request_id=rid, prompt_token_ids=(5, 6, 7), params={"max_tokens": 4}, enqueued_unix_ms=now_ms())
            await redis.hset(keys.assignment(rid), mapping={"worker": "wb", "job": job.encode()})
            await redis.sadd(keys.worker_assignments("wb"), rid)
            await redis.xadd(keys.inbox("wb"), {b"job": job.encode()})

        await submit("before")
        assert (await read_until_final(redis, keys, "before", 60))[-1].finish_reason == "length"
        busy = threading.Thread(target=lambda: _run_busy_script(server.url), daemon=True)
        busy.start()
        await asyncio.sleep(6.0)  # every command the worker sends meanwhile gets BUSY
        admin.script_kill()
        busy.join(10)
        await asyncio.to_thread(_wait_answering, admin)  # commands right after the kill may still get BUSY
        await submit("after")
        assert (await read_until_final(redis, keys, "after", 30))[-1].finish_reason == "length"
        assert not task.done(), "the worker must not stop over a busy Redis"
        assert Heartbeat.decode(await redis.get(keys.heartbeat("wb"))).worker_id == "wb"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await redis.aclose()
        admin.close()
        server.stop()


def _wait_answering(client, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except sync_redis.ResponseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _run_busy_script(url: str) -> None:
    client = sync_redis.Redis.from_url(url)
    try:
        client.eval("while true do end", 0)
    except sync_redis.RedisError:
        pass  # "Script killed by user with SCRIPT KILL"
    finally:
        client.close()


def engine_child(worker_pid: int) -> int:
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


TOKENS = 240


@pytest.mark.slow
async def test_sigstop_an_engine_with_requests_running_they_are_redispatched_and_complete():
    stack = start_stack(workers=2, policy="fixed:2", worker_args=("--engine-process",),
                        scheduler_args=("--stall-s", "3"))
    stopped = None
    try:
        texts = prompt_texts(8, chars=80)
        # long enough that a worker is seen running 4 at once (the packed CPU path decodes 48
        # tokens in a fraction of a heartbeat interval)
        reference = engine_reference(texts, TOKENS)
        channel, stub = aio_stub(stack)
        async with channel:
            async def one(text):
                toks = []
                async for resp in stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=TOKENS)):
                    toks += resp.token_ids
                return toks

            tasks = [asyncio.create_task(one(t)) for t in texts]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                busy = {w: h for w, h in heartbeats(stack).items() if h.running >= 4}
                if busy:
                    break
                await asyncio.sleep(0.05)
            assert busy, heartbeats(stack)
            victim_id = next(iter(busy))
            victim = next(s for s in stack.workers() if victim_id in s.log_path.read_text())
            stopped = engine_child(victim.proc.pid)
            os.kill(stopped, signal.SIGSTOP)  # the engine stops; the worker's event loop heartbeats on
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for text, toks in zip(texts, results):
            assert_same_greedy(text, toks, reference[text], TOKENS)
        assert "is stalled" in stack.service("scheduler").log_path.read_text()
        assert victim.alive()  # alive all along: only progress told
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        stack.stop()
