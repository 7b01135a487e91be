"""Refuse before paying: admission comes before tokenizing, tokenizing runs off the event loop,
and the prompt byte cap follows from the model's context. Under a burst of huge prompts the
running stream and the health check must not notice."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.validation import prompt_byte_cap
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_tools.stack import Stack, StackConfig
from tests.conftest import pair, tokenizer
from tests.gateway.conftest import Rig, collect, config

HUGE = "a" * 1_000_000
BURST = 20
LIMIT_S = 0.2  # the bound on a quiet machine; a slow minute raises it (see _stall_bound)


def test_the_byte_cap_bounds_every_token_of_the_shipped_tokenizer():
    tok = tokenizer(pair()[0])
    cap = prompt_byte_cap(tok.get_vocab(), 1000)
    longest_decoded = max(len(tok.decode([i]).encode()) for i in range(len(tok)))
    # Sound (no prompt that fits is refused) and not far above the real bound (huge prompts refused).
    assert longest_decoded * 1000 <= cap <= 4 * longest_decoded * 1000


async def test_admission_comes_before_tokenizing(redis_url, key_prefix):
    """A prompt too long in tokens (but under the byte cap) meets the queue cap first."""
    from gateway.server import Gateway

    target, _ = pair()
    gw = Gateway(config(redis_url, key_prefix, max_queued=1), tokenizer=tokenizer(target))
    await gw.start()
    from nightjar.service_util import connect_redis

    rig = Rig(gw, connect_redis(redis_url))
    try:
        await asyncio.sleep(0.15)
        long_prompt = " ".join(f"w{i}" for i in range(3000))  # several thousand tokens, a few KB
        assert len(long_prompt.encode()) < gw.inference.limits.max_prompt_bytes
        waiting = rig.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2))
        job = await rig.next_job()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(rig.stub.Generate(pb.GenerateRequest(prompt=long_prompt, max_tokens=2)))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await rig.emit(job.request_id, 0, [5, 6], finish="length")
        assert (await collect(waiting))[0] == [5, 6]
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # admitted now: tokenized, then refused for length
            await collect(rig.stub.Generate(pb.GenerateRequest(prompt=long_prompt, max_tokens=2)))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in exc.value.details()
    finally:
        await rig.channel.close()
        await gw.drain_and_stop()
        await rig.redis.aclose()


@pytest.fixture(scope="module")
def stack(redis_server):
    target, draft = pair()
    cfg = StackConfig(port=0, http_port=0, workers=1, redis_url=redis_server.url, key_prefix=f"b{uuid.uuid4().hex[:8]}",
                      target_path=Path(target), draft_path=Path(draft), policy="off")
    with Stack(cfg) as s:
        yield s


async def _health_probe(stub, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        latencies.append(time.perf_counter() - t0)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.01)


async def _huge_grpc(stub) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(pb.GenerateRequest(prompt=HUGE, max_tokens=4)):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
async def test_a_burst_of_huge_prompts_does_not_stall_the_running_stream_or_health(stack):
    async with grpc.aio.insecure_channel(stack.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel, \
            httpx.AsyncClient(base_url=stack.http_url, timeout=30) as http:
        stub, health = pb_grpc.InferenceServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        arrivals: list[float] = []
        stream = stub.Generate(pb.GenerateRequest(prompt="def fibonacci(n):", max_tokens=400, ignore_eos=True))
        while len(arrivals) < 5:  # running and past its prefill
            resp = await stream.read()
            if resp.token_ids:
                arrivals.append(time.perf_counter())
        stop, latencies = asyncio.Event(), []
        probe = asyncio.create_task(_health_probe(health, stop, latencies))
        burst_start = time.perf_counter()
        burst = asyncio.gather(*(_huge_grpc(stub) for _ in range(BURST)),
                               *(http.post("/completions", json={"prompt": HUGE, "max_tokens": 4}) for _ in range(BURST)))
        reader = asyncio.create_task(_read_until(stream, arrivals, burst))
        results = await burst
        burst_end = time.perf_counter()
        await asyncio.sleep(0.3)  # and a little after it
        stop.set()
        await probe
        reader.cancel()
        stream.cancel()
    codes, replies = results[:BURST], results[BURST:]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * BURST
    assert all(r.status_code in (400, 413) for r in replies), [r.status_code for r in replies]
    bound = _stall_bound(tokenizer(pair()[0]))
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= burst_start and a <= burst_end + 0.3]
    assert len(during) >= 3, "the stream produced too few tokens during the burst to judge"
    assert max(during) < bound, f"largest inter-token gap during the burst: {max(during) * 1000:.0f} ms (bound {bound * 1000:.0f})"
    assert latencies and max(latencies) < bound, f"slowest Health.Check: {max(latencies) * 1000:.0f} ms (bound {bound * 1000:.0f})"


def _stall_bound(tok) -> float:
    """What the test guards against is one huge prompt tokenized on the gateway's event loop: that
    stalls the stream and the health check for as long as the tokenizing takes. Timed here, right
    after the burst, so that a slow minute of a shared machine slows the bound with the gaps."""
    t0 = time.perf_counter()
    tok(HUGE)
    return max(LIMIT_S, 0.8 * (time.perf_counter() - t0))


async def _read_until(stream, arrivals: list[float], burst) -> None:
    while True:
        resp = await stream.read()
        if resp is grpc.aio.EOF:
            return
        if resp.token_ids:
            arrivals.append(time.perf_counter())
