"""Shared pieces of the pipeline tests: a stack on the test Redis, references, stream helpers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import grpc
import redis

from engine_support import PROMPTS, check_greedy, engine, hf_greedy, pair, run_all, tokenizer
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, SamplingParams
from nightjar_tools.stack import Stack, StackConfig
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc


def prompt_texts(n: int, chars: int = 120) -> list[str]:
    """n held-out prompts, cut to ``chars`` characters (short prompts keep 2 cores fast)."""
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    out = [t[:chars] for t in texts if t.strip()][:n]
    assert len(out) == n, "models/prompts.jsonl has too few prompts"
    return out


def start_stack(redis_url: str, workers: int, **kw) -> Stack:
    target, draft = pair()
    cfg = StackConfig(port=0, workers=workers, redis_url=redis_url, key_prefix=f"p{uuid.uuid4().hex[:8]}",
                      target_path=Path(target), draft_path=Path(draft), **kw)
    return Stack(cfg).start()


def engine_reference(texts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """The engine's own greedy output, in-process, all requests at once."""
    from worker.engine.engine import EngineRequest

    target, _ = pair()
    tok = tokenizer(target)
    eng = engine(target)
    reqs = [EngineRequest(f"ref{i}", tok.encode(t), SamplingParams(max_tokens=max_tokens)) for i, t in enumerate(texts)]
    out = run_all(eng, reqs)
    return {t: out[f"ref{i}"] for i, t in enumerate(texts)}


def assert_same_greedy(text: str, got: list[int], ref: list[int], max_tokens: int) -> None:
    """Identical to the engine's output; a difference is accepted only at a near-tie of the
    transformers reference's top-2 logits (batch composition changes float reduction order)."""
    if got == ref:
        return
    target, _ = pair()
    problem = check_greedy(hf_greedy(target, tuple(tokenizer(target).encode(text)), max_tokens), got)
    assert problem is None, f"{text[:40]!r}: {problem}\n got {got}\n engine {ref}"


async def generate(stub, text: str, max_tokens: int, **kw) -> tuple[list[int], str, pb.GenerateResponse]:
    """(token ids, text, last response) of one streamed completion."""
    toks, out, last = [], [], None
    async for resp in stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=max_tokens, **kw)):
        toks += resp.token_ids
        out.append(resp.text)
        last = resp
    return toks, "".join(out), last


def aio_stub(stack: Stack) -> tuple[grpc.aio.Channel, pb_grpc.InferenceServiceStub]:
    channel = grpc.aio.insecure_channel(stack.address)
    return channel, pb_grpc.InferenceServiceStub(channel)


def heartbeats(stack: Stack) -> dict[str, Heartbeat]:
    keys = Keys(stack.cfg.key_prefix)
    r = redis.Redis.from_url(stack.redis_url)
    try:
        out = {}
        for w in r.smembers(keys.workers):
            raw = r.get(keys.heartbeat(w.decode()))
            if raw:
                out[w.decode()] = Heartbeat.decode(raw)
        return out
    finally:
        r.close()


async def wait_kv_free(stack: Stack, baseline: int, timeout_s: float = 5.0, below: bool = False) -> int:
    """Poll the heartbeats (every 0.5 s) until the free KV blocks return to ``baseline`` (or,
    with ``below``, fall under it); returns the last value seen."""
    deadline = time.monotonic() + timeout_s
    free = -1
    while time.monotonic() < deadline:
        free = sum(h.kv_blocks_free for h in heartbeats(stack).values())
        if (free < baseline) if below else (free >= baseline):
            return free
        await asyncio.sleep(0.1)
    return free


async def idle_kv_free(stack: Stack, timeout_s: float = 10.0) -> int:
    """Free KV blocks once no worker runs or queues anything (the baseline to return to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = heartbeats(stack).values()
        if beats and all(h.running == 0 and h.waiting == 0 for h in beats):
            return sum(h.kv_blocks_free for h in beats)
        await asyncio.sleep(0.1)
    raise AssertionError("the workers did not become idle")
