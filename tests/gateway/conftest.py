"""The gateway rig: the real gateway in this process, the test standing in for the back end
(take the job the gateway queued, write its output chunks)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.server import Gateway
from nightjar.keys import Keys
from nightjar.messages import Job, OutputChunk
from nightjar.service_util import connect_redis
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import pair, tokenizer


async def take_job(redis, keys: Keys, timeout_s: float = 5.0) -> Job:
    """The oldest job on the requests stream, removed from it (no scheduler in these rigs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = await redis.xrange(keys.requests)
        if entries:
            entry_id, fields = entries[0]
            await redis.xdel(keys.requests, entry_id)
            return Job.decode(fields[b"job"])
        await asyncio.sleep(0.02)
    raise AssertionError("no job was enqueued")


def config(redis_url: str, prefix: str, **kw) -> GatewayConfig:
    target, draft = pair()
    base = dict(port=0, redis_url=redis_url, key_prefix=prefix, target_path=Path(target), draft_path=Path(draft),
                require_worker=False, health_interval_s=0.05, redis_timeout_s=0.3, read_block_ms=200)
    return GatewayConfig(**{**base, **kw})


class Rig:
    def __init__(self, gw: Gateway, redis) -> None:
        self.gw, self.redis, self.keys = gw, redis, gw.keys
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self.tok = tokenizer(str(gw.cfg.target_path))

    async def next_job(self, timeout_s: float = 5.0) -> Job:
        return await take_job(self.redis, self.keys, timeout_s)

    async def emit(self, rid: str, index: int, toks, finish: str | None = None) -> None:
        chunk = OutputChunk(rid, index, tuple(toks), finish_reason=finish, prompt_tokens=3, completion_tokens=index + len(toks))
        await self.redis.xadd(self.keys.output(rid), {b"c": chunk.encode()})


@pytest.fixture
async def rig(redis_url, key_prefix, request):
    kw = getattr(request, "param", {})
    gw = Gateway(config(redis_url, key_prefix, **kw), tokenizer=tokenizer(pair()[0]))
    await gw.start()
    redis = connect_redis(redis_url)
    r = Rig(gw, redis)
    await asyncio.sleep(0.15)  # first health poll
    yield r
    await r.channel.close()
    await gw.drain_and_stop()
    await redis.aclose()


async def collect(call):
    """(token ids, text, last response) of the rest of a stream (read() style, so it can
    follow an earlier call.read())."""
    toks, text, last = [], "", None
    while (resp := await call.read()) is not grpc.aio.EOF:
        toks += resp.token_ids
        text += resp.text
        last = resp
    return toks, text, last
