"""The whole stack over real gRPC and a real redis-server, on the shipped models:
client -> gateway -> Redis -> scheduler -> 2 workers -> Redis -> gateway -> client.

One two-worker stack serves every test in this module (starting one costs most of the time on
2 cores); the test that SIGKILLs a worker runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nightjar.messages import StepStats
from nightjar.v1 import inference_pb2 as pb
from tests.stack.conftest import (
    aio_stub,
    assert_same_greedy,
    busiest_worker,
    engine_reference,
    generate,
    heartbeats,
    idle_kv_free,
    prompt_texts,
    start_stack,
    wait_kv_free,
)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(redis_server):
    # fixed:3 without a planner: workers speculate with γ=3 throughout; output must not change.
    s = start_stack(workers=2, redis_url=redis_server.url, planner=False, policy="fixed:3", worker_threads=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def texts():
    return prompt_texts(64)


@pytest.fixture(scope="module")
def reference(texts):
    return engine_reference(texts, MAX_TOKENS)


async def test_64_concurrent_greedy_streams_match_the_engine(stack, texts, reference):
    from tests.conftest import pair, tokenizer

    tok = tokenizer(pair()[0])
    channel, stub = aio_stub(stack)
    async with channel:
        results = await asyncio.gather(*(generate(stub, t, MAX_TOKENS) for t in texts))
    for text, (toks, out, last) in zip(texts, results):
        assert_same_greedy(text, toks, reference[text], MAX_TOKENS)
        assert last.usage.completion_tokens == len(toks) and last.usage.prompt_tokens == len(tok.encode(text))
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
        assert out == tok.decode(toks, skip_special_tokens=True)  # the streamed pieces join to the whole text
        assert 0 < last.ttft_ms <= last.e2e_ms


async def test_stop_string_cuts_the_text(stack, texts, reference):
    from tests.conftest import pair, tokenizer

    tok = tokenizer(pair()[0])
    text = next(t for t in texts if len(tok.decode(reference[t])) > 12)
    full = tok.decode(reference[text], skip_special_tokens=True)
    stop = full[6:9]  # a stop string that starts after a few characters
    channel, stub = aio_stub(stack)
    async with channel:
        _, out, last = await generate(stub, text, MAX_TOKENS, stop=[stop])
    assert out == full[: full.find(stop)]
    assert last.finish_reason == pb.FINISH_REASON_STOP


async def test_cancel_and_deadline_free_kv_blocks(stack, texts):
    baseline = await idle_kv_free(stack)
    channel, stub = aio_stub(stack)
    async with channel:
        call = stub.Generate(pb.GenerateRequest(prompt=texts[0], max_tokens=400, ignore_eos=True))
        seen = 0
        async for resp in call:
            seen += len(resp.token_ids)
            if seen >= 3:
                break
        assert await wait_kv_free(stack, baseline, below=True) < baseline  # it holds blocks now
        call.cancel()
        assert await wait_kv_free(stack, baseline) >= baseline

        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await asyncio.wait_for(_deadline_call(stub, texts[1]), 30)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await wait_kv_free(stack, baseline) >= baseline


async def _deadline_call(stub, text):
    # 900 tokens take seconds even on the fastest engine path; the deadline comes first
    async for _ in stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=900, ignore_eos=True), timeout=0.5):
        pass


async def test_bad_request_gets_its_code_and_a_good_one_beside_it_completes(stack, texts, reference):
    channel, stub = aio_stub(stack)
    async with channel:
        good = asyncio.create_task(generate(stub, texts[2], MAX_TOKENS))
        for bad, field in ((dict(temperature=5.0), "temperature"), (dict(top_p=1.5), "top_p"),
                           (dict(stop=["x"] * 9), "stop"), (dict(max_tokens=100_000), "max_tokens")):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await generate(stub, texts[3], **{"max_tokens": MAX_TOKENS, **bad})
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert exc.value.details().startswith(field)
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # too long for the context: named too
            await generate(stub, "word " * 5000, MAX_TOKENS)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("prompt")
        toks, _, _ = await good
    assert_same_greedy(texts[2], toks, reference[texts[2]], MAX_TOKENS)


async def test_health_reflection_and_model_info(stack):
    channel, stub = aio_stub(stack)
    async with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "nightjar.v1.InferenceService"):
            status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.model == stack.cfg.target_path.name and info.max_context_tokens > 0 and info.vocab_size > 0
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        names = []
        async for resp in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names += [s.name for s in resp.list_services_response.service]
        assert "nightjar.v1.InferenceService" in names and "grpc.health.v1.Health" in names


async def test_every_per_request_key_is_gone_or_expiring(stack):
    """docs/pipeline.md "Keys and expiry": after traffic, per-request keys either were deleted
    (finished streams, assignments) or carry a TTL (cancel markers, abandoned streams)."""
    import redis

    r = redis.Redis.from_url(stack.redis_url)
    prefix = stack.cfg.key_prefix
    try:
        assert r.keys(f"{prefix}:assign:*") == []  # finished requests release their assignment
        for worker in heartbeats(stack):
            assert r.scard(f"{prefix}:worker_jobs:{worker}") == 0
        for pattern in ("out:*", "cancel:*", "hb:*"):
            for key in r.keys(f"{prefix}:{pattern}"):
                assert r.pttl(key) > 0, f"{key!r} has no TTL"
        assert r.xlen(f"{prefix}:requests") == 0  # everything dispatched was deleted from the queue
        assert r.xlen(f"{prefix}:stats") > 0  # the worker published its step stats
    finally:
        r.close()


async def test_planner_restart_and_policy_expiry(stack, texts, reference):
    """docs/pipeline.md "Planner restart": workers follow the planner's policy while it is fresh,
    fall back to their default γ once it is older than its TTL (serving never stops), and adopt
    the restarted planner's newer version. The stack's workers default to γ=3; the planner
    here publishes "off" (γ=0), so the γ of the last step shows whose policy is in force."""

    async def gamma_of(i) -> int:
        """Run prompt i; the γ of its last step (from the stats stream)."""
        channel, stub = aio_stub(stack)
        async with channel:
            toks, _, _ = await generate(stub, texts[i], MAX_TOKENS)
        assert_same_greedy(texts[i], toks, reference[texts[i]], MAX_TOKENS)
        r = redis.Redis.from_url(stack.redis_url)
        ((_, fields),) = r.xrevrange(f"{stack.cfg.key_prefix}:stats", count=1)
        r.close()
        return StepStats.decode(fields[b"s"]).gamma

    def version() -> int:  # the policy version every worker holds
        return min(h.policy_version for h in heartbeats(stack).values())

    async def wait_version(above: int):
        for _ in range(100):
            if version() > above:
                return version()
            await asyncio.sleep(0.1)
        raise AssertionError(f"no policy version above {above} reached the workers")

    planner = stack._spawn("planner", ["--policy", "off", "--ttl-s", "2"])
    v1 = await wait_version(-1)
    assert await gamma_of(4) == 0  # the planner's table
    planner.proc.send_signal(signal.SIGKILL)
    planner.proc.wait(10)
    await asyncio.sleep(0.7)
    last = version()
    await asyncio.sleep(2.5)  # the last policy is now older than its TTL
    assert await gamma_of(5) == 3  # the workers' default γ: a stale policy is not trusted ...
    assert version() == last  # ... though it is still held
    stack._spawn("planner", ["--policy", "off", "--ttl-s", "2"])
    assert await wait_version(last) > last >= v1
    assert await gamma_of(6) == 0


KILL_MAX_TOKENS = 24
STREAMS = 32



@pytest.mark.slow
async def test_sigkill_a_worker_mid_stream_loses_and_duplicates_nothing(stack):
    """Last in the module: SIGKILL one of the two workers in the middle of 32 streams; every
    request still completes with the engine's output, none is lost, no token comes twice."""
    texts = prompt_texts(STREAMS, chars=100)
    reference = engine_reference(texts, KILL_MAX_TOKENS)
    started = asyncio.Event()
    first_tokens = 0

    async def stream(stub, text):
        nonlocal first_tokens
        toks, responses, last = [], 0, None
        async for resp in stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=KILL_MAX_TOKENS)):
            if resp.token_ids and not toks:
                first_tokens += 1
                if first_tokens >= STREAMS // 4:
                    started.set()
            toks += resp.token_ids
            responses += 1
            last = resp
        return toks, last

    channel, stub = aio_stub(stack)
    async with channel:
        tasks = [asyncio.create_task(stream(stub, t)) for t in texts]
        await asyncio.wait_for(started.wait(), 120)
        victim, held = busiest_worker(stack)
        assert held > 0, "the victim should hold unfinished requests when it dies"
        os.kill(victim.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
    assert victim.proc.wait(5) == -signal.SIGKILL
    assert "re-dispatching" in stack.service("scheduler").log_path.read_text()  # recovery, not luck
    for text, (toks, last) in zip(texts, results):
        assert_same_greedy(text, toks, reference[text], KILL_MAX_TOKENS)  # complete, in order, nothing twice
        assert last.usage.completion_tokens == len(toks)
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
