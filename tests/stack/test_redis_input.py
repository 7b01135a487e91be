"""Malformed and oversized entries written straight into Redis: queue entries are dead-lettered
(with the reason and a truncated copy), poison jobs that decode get a final error chunk for their
client, garbage on the side channels (heartbeats, policy, stats, cancels, output streams) is
ignored, and every service keeps running and serving."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgpack
import pytest

from nightjar.messages import MAX_MESSAGE_BYTES, DeadLetter, Job, OutputChunk, Policy
from nightjar_client import AsyncClient
from tests.stack.conftest import IDLE, TOKEN, client, dead_services, hardened_stack, heartbeats, keys, wait_idle

ARRAY32_HEADER = b"\xdd\xff\xff\xff\xff"  # msgpack: "an array of 4 billion items follows" (and nothing does)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[[...0...]]]]


# (id, fields of the XADD) - none of these is a decodable Job
UNDECODABLE = [
    ("not-msgpack", {b"job": b"\xc1\xc1\xc1 not msgpack"}),
    ("empty-payload", {b"job": b""}),
    ("no-job-field", {b"other": b"x"}),
    ("list-not-map", {b"job": msgpack.packb([1, 2, 3])}),
    ("missing-request-id", {b"job": msgpack.packb({"prompt_token_ids": [1], "params": {}})}),
    ("wrong-field-types", {b"job": msgpack.packb({"request_id": 7, "prompt_token_ids": "abc", "params": []})}),
    ("bool-as-token", {b"job": msgpack.packb({"request_id": "x", "prompt_token_ids": [True], "params": {}})}),
    ("int-map-keys", {b"job": msgpack.packb({1: 2}, strict_types=False)}),
    ("array-length-lie", {b"job": ARRAY32_HEADER}),
    ("nesting-bomb", {b"job": nested(100_000)}),
    ("ext-type", {b"job": msgpack.packb(msgpack.ExtType(5, b"payload"))}),
    ("oversized", {b"job": b"\x92" + b"\x00" * (MAX_MESSAGE_BYTES + 10)}),
]


def job(rid: str, ids=(5, 6, 7), **params) -> bytes:
    return Job(request_id=rid, prompt_token_ids=tuple(ids), params={"max_tokens": 4, **params}).encode()


# (id, job bytes, finish reasons acceptable for its final chunk) - decodable but poisonous
POISON = [
    ("token-out-of-vocab", lambda rid: job(rid, ids=(10**9,)), {"rejected"}),
    ("token-negative", lambda rid: job(rid, ids=(-3, 5)), {"rejected"}),
    ("empty-prompt", lambda rid: job(rid, ids=()), {"rejected"}),
    ("prompt-over-context", lambda rid: job(rid, ids=(5,) * 5000), {"rejected"}),
    ("max-tokens-negative", lambda rid: job(rid, max_tokens=-5), {"rejected"}),
    ("temperature-nan", lambda rid: job(rid, temperature=float("nan")), {"rejected"}),
    ("params-wrong-types", lambda rid: job(rid, temperature="hot"), {"error"}),
    ("deadline-passed", lambda rid: Job(rid, (5, 6), {"max_tokens": 4}, deadline_unix_ms=1).encode(), {"deadline"}),
]


@pytest.fixture(scope="module")
def stack():
    return hardened_stack()


def dead_letters(stack) -> list[DeadLetter]:
    r = client(stack)
    try:
        return [DeadLetter.decode(f[b"dl"]) for _, f in r.xrange(keys(stack).dead_letters)]
    finally:
        r.close()


async def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def serves(stack) -> None:
    async with AsyncClient(stack.address, token=TOKEN) as c:
        done = await c.generate("The weather today is", max_tokens=4, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.token_ids) == 4


async def test_undecodable_queue_entries_are_dead_lettered(stack):
    baseline = IDLE
    r, k = client(stack), keys(stack)
    before = len(dead_letters(stack))
    ids = {name: r.xadd(k.requests, fields).decode() for name, fields in UNDECODABLE}
    letters = await wait_for(lambda: (d := dead_letters(stack)) and len(d) >= before + len(ids) and d,
                             what="every entry dead-lettered")
    by_entry = {d.entry_id: d for d in letters}
    for name, entry_id in ids.items():
        assert entry_id in by_entry, f"{name} was not dead-lettered"
        letter = by_entry[entry_id]
        assert letter.reason and letter.deliveries >= 1, name
        assert len(letter.payload) <= 64 * 1024, f"{name}: the copy must be truncated"
    assert by_entry[ids["oversized"]].reason.startswith("Job: payload of")
    r.close()
    assert await wait_idle(stack, baseline) == baseline  # queue drained, nothing pending
    assert not dead_services(stack)
    await serves(stack)


async def test_poison_jobs_end_with_an_error_chunk_and_the_worker_survives(stack):
    baseline = IDLE
    r, k = client(stack), keys(stack)
    rids = {name: f"poison-{name}-{uuid.uuid4().hex[:6]}" for name, _, _ in POISON}
    for name, make, _ in POISON:
        r.xadd(k.requests, {b"job": make(rids[name])})

    def finals():
        out = {}
        for name, rid in rids.items():
            entries = r.xrange(k.output(rid))
            if entries:
                out[name] = OutputChunk.decode(entries[-1][1][b"c"])
        return len(out) == len(rids) and out

    got = await wait_for(finals, what="a final chunk for every poison job")
    for name, _, reasons in POISON:
        assert got[name].finish_reason in reasons, f"{name}: {got[name]}"
        assert got[name].error, f"{name}: the final chunk must say why"
        assert 0 < r.pttl(k.output(rids[name])) <= 600_000, f"{name}: the output stream must expire"
    r.close()
    assert await wait_idle(stack, baseline) == baseline
    assert not dead_services(stack)
    await serves(stack)


async def test_garbage_in_a_worker_inbox_is_dead_lettered(stack):
    baseline = IDLE
    (worker,) = heartbeats(stack)
    r, k = client(stack), keys(stack)
    before = len(dead_letters(stack))
    bad = [r.xadd(k.inbox(worker), {b"job": b"\xc1 junk"}).decode(), r.xadd(k.inbox(worker), {b"nojob": b"1"}).decode(),
           r.xadd(k.inbox(worker), {b"job": b"\x92" + b"\x00" * (MAX_MESSAGE_BYTES + 1)}).decode()]
    letters = await wait_for(lambda: (d := dead_letters(stack)) and len(d) >= before + len(bad) and d,
                             what="inbox garbage dead-lettered")
    assert set(bad) <= {d.entry_id for d in letters}
    assert r.xlen(k.inbox(worker)) == 0
    r.close()
    assert await wait_idle(stack, baseline) == baseline
    assert not dead_services(stack)
    await serves(stack)


async def test_garbage_on_side_channels_is_ignored(stack):
    """Heartbeat, policy, stats, cancel channel: a malformed record never stops a service."""
    r, k = client(stack), keys(stack)
    fake = f"w-fake-{uuid.uuid4().hex[:4]}"
    policy_before = r.get(k.policy)
    r.set(k.heartbeat(fake), b"\xc1 not a heartbeat", px=5000)
    r.sadd(k.workers, fake)
    r.set(k.policy, b"\xc1 not a policy")
    r.publish(k.policy_channel, b"\xc1 not a policy")
    r.publish(k.policy_channel, msgpack.packb({"version": "x"}))
    r.publish(k.cancel_channel, b"\xc1 not a cancel")
    r.publish(k.cancel_channel, b"\x00" * 100_000)
    for payload in (b"\xc1", msgpack.packb({"worker_id": 3}), nested(50_000)):
        r.xadd(k.stats, {b"s": payload})
    r.xadd(k.stats, {b"nothing": b"here"})
    try:
        await serves(stack)
        await asyncio.sleep(1.0)  # the planner reads the stats stream every 200 ms
        assert not dead_services(stack)
        # The planner republishes a valid policy over the garbage (every ttl/3).
        assert await wait_for(lambda: _decodes(r.get(k.policy)), timeout_s=15, what="a valid policy again")
        await serves(stack)
    finally:
        r.delete(k.heartbeat(fake))
        r.srem(k.workers, fake)
        if not _decodes(r.get(k.policy)) and policy_before:
            r.set(k.policy, policy_before)
        r.close()


def _decodes(raw) -> bool:
    try:
        return raw is not None and Policy.decode(raw) is not None
    except ValueError:
        return False


async def test_garbage_in_an_output_stream_is_skipped_by_the_gateway(stack):
    r, k = client(stack), keys(stack)
    async with AsyncClient(stack.address, token=TOKEN) as c:
        task = asyncio.create_task(c.generate("A long tale begins", max_tokens=48, ignore_eos=True))
        out = await wait_for(lambda: list(r.scan_iter(match=f"{k.prefix}:out:*", count=1000)), what="an output stream")
        for name in out:
            r.xadd(name, {b"c": b"\xc1 not a chunk"})
            r.xadd(name, {b"x": b"no chunk field"})
        done = await asyncio.wait_for(task, 120)
    r.close()
    assert done.finish_reason == "length" and len(done.token_ids) == 48
    assert not dead_services(stack)
