"""Streams in flight across a Redis restart (issue 21, item 7).

Redis runs with AOF (fsync every second), as compose runs it. It is stopped cleanly (SIGTERM:
it fsyncs the AOF) in the middle of streams, stays away for a moment (a failover blip), and
comes back on the same port with the same data. Every client gets its whole, correct stream,
without a retry: the gateway's output reader waits the outage out instead of failing every
stream at the first XREAD error. A Redis that comes back without its data is the other case:
those streams fail UNAVAILABLE as soon as it answers, not after the retry window.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from pathlib import Path

import pytest
import redis

from nightjar_client import NO_RETRY, AsyncClient
from nightjar_client import errors as sdk
from nightjar_tools.redis_server import EmbeddedRedis
from nightjar_tools.stack import Stack, StackConfig
from tests.conftest import pair
from tests.stack.conftest import assert_same_greedy, dead_services

PROMPTS = ["The old lighthouse keeper", "In the beginning of the"]
N_TOKENS = 200
OUTAGE_S = 1.5


@pytest.fixture(scope="module")
def aof_stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("redis-aof")
    server = EmbeddedRedis(password=secrets.token_hex(8), appendonly=True, data_dir=str(data)).start()
    target, draft = pair()
    cfg = StackConfig(port=0, workers=1, redis_url=server.url, key_prefix=f"a{uuid.uuid4().hex[:8]}",
                      target_path=Path(target), draft_path=Path(draft), policy="fixed:2", worker_threads=1)
    stack = Stack(cfg).start()
    stack.redis = server  # stop() stops it too; the tests restart it in place
    yield stack
    stack.stop()


def restart(stack: Stack, *, keep_data: bool, outage_s: float = OUTAGE_S) -> None:
    old = stack.redis
    old.stop()  # SIGTERM: Redis fsyncs the AOF and exits
    if not keep_data:
        for f in Path(old.data_dir).iterdir():
            f.unlink() if f.is_file() else None
    time.sleep(outage_s)
    stack.redis = EmbeddedRedis(port=old.port, password=old.password, appendonly=True, data_dir=old.data_dir).start()


async def collect(client: AsyncClient, prompt: str, started: asyncio.Event, n: int) -> tuple[list[int], int, str]:
    """(token ids, how many had arrived when ``started`` was set by someone, finish reason)."""
    tokens, at_restart, reason = [], -1, ""
    async for delta in client.stream(prompt, max_tokens=n, ignore_eos=True, deadline_s=120):
        tokens += delta.token_ids
        if started.is_set() and at_restart < 0:
            at_restart = len(tokens) - len(delta.token_ids)
        reason = delta.finish_reason or reason
    return tokens, at_restart, reason


@pytest.mark.slow
async def test_streams_survive_a_redis_restart_with_aof(aof_stack):
    stack = aof_stack
    async with AsyncClient(stack.address) as c:
        reference = {p: (await c.generate(p, max_tokens=N_TOKENS, ignore_eos=True)).token_ids for p in PROMPTS}
    restarted = asyncio.Event()
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:  # no SDK retry: the stream itself survives
        tasks = [asyncio.create_task(collect(c, p, restarted, N_TOKENS)) for p in PROMPTS]
        r = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
        deadline = time.monotonic() + 60
        while not all(r.xlen(k) >= 3 for k in r.scan_iter(match=f"{stack.cfg.key_prefix}:out:*")) \
                or len(list(r.scan_iter(match=f"{stack.cfg.key_prefix}:out:*"))) < len(PROMPTS):
            assert time.monotonic() < deadline, "the streams never started"
            await asyncio.sleep(0.02)
        r.close()
        await asyncio.to_thread(restart, stack, keep_data=True)
        restarted.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for prompt, (tokens, at_restart, reason) in zip(PROMPTS, results):
        assert reason == "length" and len(tokens) == N_TOKENS, (prompt, len(tokens), reason)
        assert 0 < at_restart < N_TOKENS, f"the restart must fall mid-stream (tokens before it: {at_restart})"
        assert_same_greedy(prompt, tokens, list(reference[prompt]), N_TOKENS)
    assert not dead_services(stack)


@pytest.mark.slow
async def test_a_redis_back_without_its_data_fails_streams_at_once(aof_stack):
    """Same restart, but the AOF is gone (a new, empty Redis): the stream fails UNAVAILABLE
    right after Redis answers again, not after the retry window; new requests then work."""
    stack = aof_stack
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:
        stream = c.stream(PROMPTS[0], max_tokens=600, ignore_eos=True, deadline_s=120)
        await anext(stream)
        await asyncio.to_thread(restart, stack, keep_data=False, outage_s=0.5)
        back = time.monotonic()
        with pytest.raises(sdk.Unavailable):
            async for _ in stream:
                pass
        assert time.monotonic() - back < 3.0, "a lost stream must fail once Redis answers, not at the retry limit"
    await asyncio.to_thread(stack.wait_ready, 120, 1)
    async with AsyncClient(stack.address) as c:
        done = await c.generate(PROMPTS[1], max_tokens=8, ignore_eos=True, deadline_s=120)
    assert len(done.token_ids) == 8


@pytest.mark.parametrize("direct", [False, True], ids=["queue", "direct"])
async def test_a_full_redis_refuses_new_requests_unavailable(direct):
    """compose's Redis has maxmemory with noeviction: when full it refuses writes rather than
    evicting queue entries. The client gets UNAVAILABLE (retried by the SDK) naming the cause,
    not INTERNAL."""
    from gateway.errors import Unavailable
    from gateway.request_queue import RequestQueue
    from nightjar.dispatch_lease import DirectDispatch
    from nightjar.keys import Keys
    from nightjar.messages import Job
    from nightjar.service_util import connect_redis

    with EmbeddedRedis() as server:
        r = connect_redis(server.url)
        keys = Keys("full")
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", 1)  # already over: every write is refused
        queue = RequestQueue(r, keys, reader=None, cancel_ttl_s=60,
                             direct=DirectDispatch(r, keys, 60.0) if direct else None)
        with pytest.raises(Unavailable, match="full"):
            await queue.enqueue(Job(request_id="r0", prompt_token_ids=(1, 2), params={"max_tokens": 2}))
        await r.aclose()


async def test_pooled_connections_reconnect_after_a_redis_restart():
    """After a restart every pooled connection is dead. The first command on each reconnects
    instead of failing its request ("Connection closed by server": a CI failure of the test
    above, whose first request met a connection pooled before the previous test's restart)."""
    from nightjar.service_util import connect_redis

    server = EmbeddedRedis(password=secrets.token_hex(8)).start()
    r = connect_redis(server.url)
    try:
        # Several connections in the pool, all made before the restart.
        await asyncio.gather(*(r.blpop(f"k{i}", timeout=0.2) for i in range(4)))
        assert len(r.connection_pool._available_connections) >= 2
        port, password = server.port, server.password
        server.stop()
        server = EmbeddedRedis(port=port, password=password).start()
        for i in range(4):  # each takes the next stale connection from the pool
            assert await r.incr("n") == i + 1
    finally:
        await r.aclose()
        server.stop()
