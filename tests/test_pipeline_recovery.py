"""Two workers; one is SIGKILLed in the middle of 32 streams. Every request still completes
with the engine's output, none is lost, and the client sees no token twice."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis

from pipeline_support import aio_stub, assert_same_greedy, engine_reference, prompt_texts, start_stack
from nightjar.keys import Keys
from nightjar.v1 import inference_pb2 as pb

MAX_TOKENS = 24
STREAMS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_server):
    s = start_stack(redis_server.url, workers=2, planner=False, policy="off", worker_threads=1)
    yield s
    s.stop()


def busiest_worker(stack):
    """(service, assignments) of the worker holding the most unfinished requests right now."""
    keys = Keys(stack.cfg.key_prefix)
    r = redis.Redis.from_url(stack.redis_url)
    try:
        best = None
        for svc in stack.workers():
            wid = next((w.decode() for w in r.smembers(keys.workers) if f"-{svc.proc.pid}-" in w.decode()), None)
            n = r.scard(keys.worker_assignments(wid)) if wid else 0
            if best is None or n > best[1]:
                best = (svc, n)
        return best
    finally:
        r.close()


async def test_sigkill_a_worker_mid_stream_loses_and_duplicates_nothing(stack):
    texts = prompt_texts(STREAMS, chars=100)
    reference = engine_reference(texts, MAX_TOKENS)
    started = asyncio.Event()
    first_tokens = 0

    async def stream(stub, text):
        nonlocal first_tokens
        toks, responses, last = [], 0, None
        async for resp in stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=MAX_TOKENS)):
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
        assert_same_greedy(text, toks, reference[text], MAX_TOKENS)  # complete, in order, nothing twice
        assert last.usage.completion_tokens == len(toks)
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
