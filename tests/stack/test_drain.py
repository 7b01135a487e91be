"""A worker that gets SIGTERM takes no new work: its heartbeat says ``draining`` at once, the
scheduler and the gateway's lease script skip it, and jobs it was sent but had not started go
back to the scheduler. Two workers on a real stack (embedded Redis, real models)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from nightjar.messages import StepStats
from nightjar.v1 import inference_pb2 as pb
from tests.stack.conftest import aio_stub, client, heartbeats, keys, start_stack

SHORT_TOKENS = 8


@pytest.fixture(scope="module")
def stack():
    s = start_stack(workers=2, policy="fixed:2")
    yield s
    s.stop()


async def first_token_then_rest(stub, prompt: str, max_tokens: int, started: float):
    ttft, toks = None, []
    async for resp in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)):
        if resp.token_ids and ttft is None:
            ttft = time.monotonic() - started
        toks += resp.token_ids
    return ttft, toks


def stats_of(stack, worker: str, since_ms: int) -> list[StepStats]:
    r = client(stack)
    try:
        out = [StepStats.decode(f[b"s"]) for _, f in r.xrange(keys(stack).stats, min=f"{since_ms}-0")]
    finally:
        r.close()
    return [s for s in out if s.worker_id == worker]


@pytest.mark.slow
async def test_sigterm_a_worker_new_requests_go_to_the_other_at_once(stack):
    await asyncio.to_thread(stack.wait_ready, 120, 2)
    channel, stub = aio_stub(stack)
    async with channel:
        long_call = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=1000, ignore_eos=True))
        first = await asyncio.wait_for(long_call.read(), 60)
        assert first.token_ids
        deadline = time.monotonic() + 5
        while not (busy := [w for w, hb in heartbeats(stack).items() if hb.running > 0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(busy) == 1, heartbeats(stack)
        a = busy[0]
        # Which process is A: the one whose log names it.
        victim = next(s for s in stack.workers() if a in s.log_path.read_text())
        sigterm_ms = int(time.time() * 1000)
        victim.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(
            first_token_then_rest(stub, f"A short request number {i}", SHORT_TOKENS, t0) for i in range(8))), 60)
        for ttft, toks in results:
            assert len(toks) == SHORT_TOKENS
            assert ttft is not None and ttft < 1.0, [round(t, 2) for t, _ in results]
        # A prefilled nothing after SIGTERM: everything new ran on B.
        after = stats_of(stack, a, sigterm_ms)
        assert all(s.prefill_tokens == 0 and s.batch_size <= 1 for s in after), after[:3]
        assert heartbeats(stack)[a].draining  # still finishing its long request
        long_call.cancel()  # so its drain ends now rather than after 1000 tokens
    assert await asyncio.to_thread(victim.proc.wait, 30) == 0
