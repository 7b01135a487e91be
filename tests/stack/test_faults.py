"""Faults on a two-worker stack: SIGKILL the scheduler and the planner mid-stream and restart
them; restart Redis; restart the gateway; 1,000 cancelled requests. Nothing accepted is lost,
nothing stays allocated, and the stack serves again after every fault.

(SIGKILL of a worker mid-stream is tests/stack/test_pipeline.py's.) What each fault does to requests
in flight is documented in docs/reliability.md; the assertions here are that documentation.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_client import NO_RETRY, AsyncClient, RetryPolicy
from nightjar_client import errors as sdk
from nightjar_tools.redis_server import EmbeddedRedis
from tests.stack.conftest import (
    IDLE,
    assert_same_greedy,
    client,
    dead_services,
    heartbeats,
    keys,
    keys_without_ttl,
    per_request_keys_without_ttl,
    respawn,
    start_stack,
    wait_idle,
)

PROMPTS = ["The old lighthouse keeper", "In the beginning of the", "My favourite recipe is"]
N_TOKENS = 24
PATIENT = RetryPolicy(max_attempts=60, initial_backoff_s=0.2, max_backoff_s=1.0)


@pytest.fixture(scope="module")
def stack():
    s = start_stack(workers=2, policy="fixed:2", scheduler_args=("--claim-idle-ms", "2000"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(stack):
    async def run():
        async with AsyncClient(stack.address) as c:
            return {p: (await c.generate(p, max_tokens=N_TOKENS, ignore_eos=True)).token_ids for p in PROMPTS}

    return asyncio.run(run())


async def ready(stack) -> None:
    await asyncio.to_thread(stack.wait_ready, 120, 2)


def policy_versions(stack) -> set[int]:
    return {h.policy_version for h in heartbeats(stack).values()}


async def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.1)
    return value


async def drain(stream) -> None:
    async for _ in stream:
        pass


def check_complete(results, reference) -> None:
    for prompt, done in results:
        assert done.finish_reason == "length", done
        assert done.usage.completion_tokens == N_TOKENS == len(done.token_ids), "lost or duplicated tokens"
        assert_same_greedy(prompt, list(done.token_ids), list(reference[prompt]), N_TOKENS)


@pytest.mark.slow
async def test_sigkill_scheduler_then_planner_and_restart_them(stack, reference):
    await ready(stack)
    baseline = IDLE
    await wait_for(lambda: min(policy_versions(stack)) >= 0, 30, "a policy in force on both workers")
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:
        async def one(prompt):
            return prompt, await c.generate(prompt, max_tokens=N_TOKENS, ignore_eos=True)

        first = [asyncio.create_task(one(PROMPTS[i % 3])) for i in range(9)]
        await asyncio.sleep(0.5)  # some are dispatched and streaming, some still queued
        sched = stack.service("scheduler")
        sched.proc.send_signal(signal.SIGKILL)
        sched.proc.wait()
        # Accepted while no scheduler runs: they wait in the requests stream.
        second = [asyncio.create_task(one(PROMPTS[i % 3])) for i in range(6)]
        planner = stack.service("planner")
        planner.proc.send_signal(signal.SIGKILL)
        planner.proc.wait()
        await asyncio.sleep(0.6)  # a heartbeat later
        last = policy_versions(stack)
        await asyncio.sleep(1.5)
        # Workers keep serving on the last policy they got (it is younger than its TTL).
        assert policy_versions(stack) == last and min(last) >= 0
        version = max(last)
        assert len(heartbeats(stack)) == 2
        respawn(stack, sched)
        respawn(stack, planner)
        results = await asyncio.wait_for(asyncio.gather(*first, *second), 180)
    check_complete(results, reference)
    # The restarted planner publishes above the version it found.
    await wait_for(lambda: min(policy_versions(stack)) > version, 60, "the new planner's policy")
    assert await wait_idle(stack, baseline) == baseline, heartbeats(stack)
    assert not dead_services(stack)


@pytest.mark.slow
async def test_gateway_restart_the_sdk_retry_gets_through(stack, reference):
    await ready(stack)
    baseline = IDLE
    async with AsyncClient(stack.address, retry=PATIENT) as c:
        # SIGTERM drains: the stream running at that moment still completes.
        running = asyncio.create_task(c.generate(PROMPTS[0], max_tokens=N_TOKENS, ignore_eos=True))
        await asyncio.sleep(0.3)
        gw = stack.service("gateway")
        gw.proc.send_signal(signal.SIGTERM)
        drained = await asyncio.wait_for(running, 60)
        check_complete([(PROMPTS[0], drained)], reference)
        gw.proc.wait(30)
        # Nobody listening: a call without retries fails UNAVAILABLE at once.
        async with AsyncClient(stack.address, retry=NO_RETRY) as bare:
            t0 = time.monotonic()
            with pytest.raises(sdk.Unavailable):
                await bare.generate(PROMPTS[1], max_tokens=2, deadline_s=10)
            assert time.monotonic() - t0 < 5
        respawn(stack, gw)
        # The same client (same channel) retries through the restart.
        done = await c.generate(PROMPTS[1], max_tokens=N_TOKENS, ignore_eos=True, deadline_s=150)
        check_complete([(PROMPTS[1], done)], reference)

        # SIGKILL: no drain. The stream in progress fails UNAVAILABLE (tokens were already
        # delivered, so the SDK does not retry it); the worker finishes it for nobody.
        stream = c.stream(PROMPTS[2], max_tokens=300, ignore_eos=True)
        await anext(stream)  # tokens are flowing
        gw = stack.service("gateway")
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait()
        with pytest.raises(sdk.Unavailable):
            await asyncio.wait_for(drain(stream), 30)
        respawn(stack, gw)
        done = await c.generate(PROMPTS[2], max_tokens=N_TOKENS, ignore_eos=True, deadline_s=150)
        check_complete([(PROMPTS[2], done)], reference)
    assert await wait_idle(stack, baseline, timeout_s=120) == baseline
    assert not dead_services(stack)


@pytest.mark.slow
async def test_redis_restart_unavailable_quickly_then_serves_again(stack, reference):
    """A non-persistent Redis goes away and comes back empty on the same port."""
    await ready(stack)
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:
        stream = c.stream(PROMPTS[0], max_tokens=300, ignore_eos=True)
        await anext(stream)  # tokens are flowing
        port = stack.redis.port
        stack.redis.stop()
        outage_s = time.monotonic()
        # Requests in flight when Redis went away fail UNAVAILABLE (their queue and output
        # streams are gone with it); none hangs.
        with pytest.raises(sdk.Unavailable):
            await asyncio.wait_for(drain(stream), 30)
        # New requests are refused UNAVAILABLE quickly during the outage.
        await asyncio.sleep(max(0.0, outage_s + 1.0 - time.monotonic()))
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(sdk.Unavailable):
                await c.generate(PROMPTS[1], max_tokens=2, deadline_s=20)
            assert time.monotonic() - t0 < 2.5, "UNAVAILABLE must come fast, not after a timeout"
        assert not dead_services(stack), "no service may exit because Redis went away"
        stack.redis = EmbeddedRedis(port=port, password=stack.redis.password).start()  # empty: nothing was persisted
    async with AsyncClient(stack.address, retry=PATIENT) as c:
        results = await asyncio.gather(*(c.generate(p, max_tokens=N_TOKENS, ignore_eos=True, deadline_s=120)
                                         for p in PROMPTS))
    check_complete(list(zip(PROMPTS, results)), reference)
    await ready(stack)
    # The planner recreated its group in the new Redis and publishes again.
    r = client(stack)
    try:
        await wait_for(lambda: r.get(keys(stack).policy) is not None, 30, "a policy in the new Redis")
    finally:
        r.close()
    assert len(heartbeats(stack)) == 2  # both workers re-registered in the new Redis
    assert not dead_services(stack)


@pytest.mark.slow
async def test_more_concurrent_streams_than_a_redis_pool_default(stack):
    """Each stream holds a Redis connection while it waits for output; redis-py 8 capped a
    client at 100 connections, so stream 101 failed UNAVAILABLE ("Too many connections")."""
    await ready(stack)
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:
        done = await asyncio.wait_for(asyncio.gather(*(
            c.generate(f"{PROMPTS[i % 3]} {i}", max_tokens=6, ignore_eos=True) for i in range(160))), 240)
    assert all(d.finish_reason == "length" and len(d.token_ids) == 6 for d in done)
    assert await wait_idle(stack, IDLE, timeout_s=60) == IDLE


@pytest.mark.slow
async def test_a_thousand_cancelled_requests_leave_nothing_behind(stack):
    await ready(stack)
    baseline = IDLE
    durable_before = keys_without_ttl(stack)
    channel = grpc.aio.insecure_channel(stack.address)
    stub = pb_grpc.InferenceServiceStub(channel)
    outcomes: dict[str, int] = {}

    async def cancelled(i: int) -> None:
        call = stub.Generate(pb.GenerateRequest(prompt=f"{PROMPTS[i % 3]} {i}", max_tokens=200, ignore_eos=True))
        try:
            if i % 2:  # half after their first token, half while still queued
                await asyncio.wait_for(call.read(), 30)
            else:
                await asyncio.sleep(0.01 * (i % 7))
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
            kind = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            outcomes[kind] = outcomes.get(kind, 0) + 1
        call.cancel()
        outcomes["cancelled"] = outcomes.get("cancelled", 0) + 1

    for wave in range(10):
        await asyncio.gather(*(cancelled(wave * 100 + i) for i in range(100)))
    await channel.close()
    assert outcomes.get("cancelled") == 1000, outcomes
    assert outcomes.get("RESOURCE_EXHAUSTED", 0) == 0 and outcomes.get("timeout", 0) == 0, outcomes
    assert await wait_idle(stack, baseline, timeout_s=120) == baseline  # KV blocks, queues, assignments
    r, k = client(stack), keys(stack)
    try:
        # Keys that never expire are service-level ones (queues, worker set, policy, planner
        # state), never one named after a request.
        assert not per_request_keys_without_ttl(stack)
        new = {n[len(k.prefix) + 1:].split(b":", 1)[0] for n in keys_without_ttl(stack) - durable_before}
        assert new <= {b"planner", b"stats", b"dlq", b"policy", b"requests", b"workers", b"inbox"}, new
        # What is left per request (cancel markers, aborted output streams) expires within its TTL.
        leftovers = list(r.scan_iter(match=f"{k.prefix}:*", count=1000))
        # (-1 = no TTL: the service-level keys checked above; -2 = expired meanwhile)
        ttls = [t for t in (r.pttl(name) for name in leftovers if name not in durable_before) if t >= 0]
        assert all(t <= 600_000 for t in ttls), sorted(ttls)[-5:]
    finally:
        r.close()
    assert not dead_services(stack)
