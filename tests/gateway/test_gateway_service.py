"""The real gateway (in this process, real gRPC on loopback, real redis-server) with the test
playing the back end: it reads jobs from the requests stream and writes output chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import Gateway
from nightjar.keys import Keys
from nightjar.messages import Cancel, OutputChunk
from nightjar.service_util import connect_redis
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_tools.redis_server import EmbeddedRedis, free_port
from tests.conftest import pair, tokenizer
from tests.gateway.conftest import collect, config, take_job


async def test_rerun_chunks_are_deduplicated_by_index(rig):
    ids = rig.tok.encode("hello world, this is a longer sentence")[:6]
    task = asyncio.create_task(collect(rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=6))))
    job = await rig.next_job()
    assert job.params["max_tokens"] == 6 and list(job.prompt_token_ids) == rig.tok.encode("hi")
    await rig.emit(job.request_id, 0, ids[:2])
    await rig.emit(job.request_id, 2, ids[2:3])
    await rig.emit(job.request_id, 0, ids[:4])  # the worker died; its replacement starts over
    await rig.emit(job.request_id, 4, ids[4:6], finish="length")
    toks, text, last = await task
    assert toks == ids and text == rig.tok.decode(ids)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 6
    await asyncio.sleep(0.1)
    assert not await rig.redis.exists(rig.keys.output(job.request_id))  # read to the end: deleted


async def test_client_cancel_sets_the_cancel_key_and_publishes(rig):
    async with rig.redis.pubsub() as ps:
        await ps.subscribe(rig.keys.cancel_channel)
        call = rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=50))
        job = await rig.next_job()
        await rig.emit(job.request_id, 0, [5])
        await call.read()
        call.cancel()
        msg = None
        for _ in range(100):
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if msg:
                break
        assert msg is not None and Cancel.decode(msg["data"]).request_id == job.request_id
    assert 0 < await rig.redis.pttl(rig.keys.cancel(job.request_id)) <= 600_000
    assert rig.gw.table.in_flight == 0


@pytest.mark.parametrize("rig", [{"max_queued": 2}], indirect=True)
async def test_queue_cap_gives_resource_exhausted_with_retry_after(rig):
    waiting = [rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4)) for _ in range(2)]
    jobs = [await rig.next_job(), await rig.next_job()]  # admitted; no first token yet
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(rig.stub.Generate(pb.GenerateRequest(prompt="one too many", max_tokens=4)))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailer = dict(exc.value.trailing_metadata())
    assert int(trailer["retry-after-ms"]) >= 200
    for job in jobs:  # the queue drains: admission opens again
        await rig.emit(job.request_id, 0, [5, 6], finish="length")
    for call in waiting:
        assert (await collect(call))[0] == [5, 6]
    await asyncio.sleep(0.2)  # the backlog (XLEN) is polled: let it see the emptied queue
    task = asyncio.create_task(collect(rig.stub.Generate(pb.GenerateRequest(prompt="now fits", max_tokens=1))))
    job = await rig.next_job()
    await rig.emit(job.request_id, 0, [7], finish="length")
    assert (await task)[0] == [7]


@pytest.mark.parametrize("rig", [{"max_queued": 2}], indirect=True)
async def test_undispatched_backlog_counts_against_the_cap(rig):
    for _ in range(2):  # jobs no scheduler took (e.g. enqueued by another gateway)
        await rig.redis.xadd(rig.keys.requests, {b"job": b"x"})
    await asyncio.sleep(0.2)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4)))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("rig", [{"auth_token": "s3cret"}], indirect=True)
async def test_bearer_auth(rig):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await rig.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(rig.stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=(("authorization", "Bearer s3crex"),)))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = await rig.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer s3cret"),))
    assert info.model == rig.gw.cfg.model_name
    health = health_pb2_grpc.HealthStub(rig.channel)  # probes need no token
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING


async def test_error_chunk_becomes_a_status(rig):
    for reason, code in (("deadline", grpc.StatusCode.DEADLINE_EXCEEDED), ("error", grpc.StatusCode.INTERNAL),
                         ("rejected", grpc.StatusCode.INVALID_ARGUMENT)):
        task = asyncio.create_task(collect(rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4))))
        job = await rig.next_job()
        chunk = OutputChunk(job.request_id, 0, finish_reason=reason, error=f"because {reason}")
        await rig.redis.xadd(rig.keys.output(job.request_id), {b"c": chunk.encode()})
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await task
        assert exc.value.code() == code and f"because {reason}" in exc.value.details()


async def test_drain_finishes_running_streams_and_refuses_new_ones(rig):
    call = rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4))
    job = await rig.next_job()
    await rig.emit(job.request_id, 0, [5])
    await call.read()
    drain = asyncio.create_task(rig.gw.drain_and_stop())
    await asyncio.sleep(0.1)
    health = health_pb2_grpc.HealthStub(rig.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(rig.stub.Generate(pb.GenerateRequest(prompt="late", max_tokens=4)))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
    await rig.emit(job.request_id, 1, [6], finish="length")  # the running stream still completes
    rest = await collect(call)
    assert rest[0] == [6] and rest[2].finish_reason == pb.FINISH_REASON_LENGTH
    await drain


async def served_once(stub, redis_url: str, key_prefix: str) -> None:
    """One 1-token request through the gateway, answered as a worker would: it must be queued."""
    task = asyncio.create_task(collect(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=1))))
    r = connect_redis(redis_url)
    try:
        job = await take_job(r, Keys(key_prefix))
        await r.xadd(Keys(key_prefix).output(job.request_id),
                     {b"c": OutputChunk(job.request_id, 0, (9,), finish_reason="length").encode()})
        assert (await task)[0] == [9]
    finally:
        await r.aclose()


@contextlib.asynccontextmanager
async def gateway_on_own_redis(key_prefix: str, **kw):
    """(Redis server, gateway, channel): a gateway on a Redis of its own, which the test may stop
    and start; all three stopped after."""
    server = EmbeddedRedis(port=free_port()).start()
    gw = Gateway(config(server.url, key_prefix, **kw), tokenizer=tokenizer(pair()[0]))
    await gw.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
    try:
        yield server, gw, channel
    finally:
        await channel.close()
        await gw.drain_and_stop()
        server.stop()


async def test_unavailable_fast_while_redis_is_down_and_back_after(key_prefix):
    async with gateway_on_own_redis(key_prefix) as (server, _, channel):
        stub = pb_grpc.InferenceServiceStub(channel)
        server.stop()
        await asyncio.sleep(0.5)  # a few health polls
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4)))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 0.5
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
        server.start()  # same port
        for _ in range(50):
            if (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.1)
        await served_once(stub, server.url, key_prefix)


async def test_a_request_right_after_redis_returns_is_served_before_the_next_poll(key_prefix):
    """The health poll said "unreachable" and its next turn is up to a second away: a request
    that arrives as Redis comes back is admitted (the gateway asks Redis again), not refused
    for the poll's stale answer."""
    async with gateway_on_own_redis(key_prefix, health_interval_s=1.0) as (server, gw, channel):
        server.stop()
        deadline = time.monotonic() + 5
        while gw.table.redis_ok:
            assert time.monotonic() < deadline, "the poll never noticed Redis was gone"
            await asyncio.sleep(0.01)
        server.start()  # same port, well before the poll's next turn
        await served_once(pb_grpc.InferenceServiceStub(channel), server.url, key_prefix)


async def test_the_deadline_travels_as_the_budget_left(rig):
    call = rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=30)
    job = await rig.next_job()
    # The budget, not a time on the gateway's clock: a receiver counts it on its own.
    assert 25_000 < job.deadline_budget_ms <= 30_000 and job.deadline_unix_ms == 0
    await rig.emit(job.request_id, 0, (5, 6), finish="length")
    await collect(call)
