"""Redis Cluster failover, and a reshard, while streams run (issue 21; docs/reliability.md).

Three primaries with one replica each, AOF ``everysec`` on every node, a whole stack on a
``redis+cluster://`` URL; greedy streams are running when the primary that owns the stack's slot
fails over (manual, SIGKILL + TAKEOVER, SIGKILL + automatic) or its slot moves. What a failover
cannot lose is asserted exactly; what it may lose must fail loudly, never as a hole.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from nightjar.keys import Keys
from nightjar_client import NO_RETRY, AsyncClient
from nightjar_client import errors as sdk
from nightjar_tools.stack import Stack, StackConfig
from tests.conftest import pair
from tests.redis_cluster import LocalCluster
from tests.stack.conftest import assert_same_greedy, dead_services

PROMPTS = ["The old lighthouse keeper", "In the beginning of the", "She opened the door and"]
N_TOKENS = 160
STARTED = 8  # tokens every stream has before the failover begins
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1, appendonly=True) as c:
        yield c


def _stack(cluster: LocalCluster) -> Stack:
    target, draft = pair()
    while True:  # a prefix whose slot's primary has a replica (an earlier test may have killed one)
        prefix = f"{{f{uuid.uuid4().hex[:6]}}}"
        if cluster.replicas_of(cluster.owner(Keys(prefix).policy)):
            break
    kw = {"log_dir": Path(os.environ["NIGHTJAR_TEST_LOG_DIR"]) / prefix} if os.environ.get("NIGHTJAR_TEST_LOG_DIR") else {}
    return Stack(StackConfig(port=0, workers=1, key_prefix=prefix, redis_url=cluster.url, target_path=Path(target),
                             draft_path=Path(draft), policy="fixed:2", worker_threads=1, **kw))


def _assert_whole(results, reference: dict, after: list[int], event: str) -> None:
    """Every stream complete and token-identical to its reference, ``event`` mid-stream, and a
    request after it served like one before it."""
    for prompt, (tokens, at_event, end) in zip(PROMPTS, results):
        assert end == "length" and len(tokens) == N_TOKENS, (prompt, len(tokens), end)
        assert 0 < at_event < N_TOKENS, f"{event} must fall mid-stream (tokens before it: {at_event})"
        assert_same_greedy(prompt, tokens, reference[prompt], N_TOKENS)
    assert len(after) == N_TOKENS
    assert_same_greedy(PROMPTS[0], after, reference[PROMPTS[0]], N_TOKENS)


async def _collect(c: AsyncClient, prompt: str, progress: dict[str, int], failing: asyncio.Event):
    """(token ids, tokens that had arrived when the failover began or -1 if the stream ended
    before, finish reason or the error that ended the stream)."""
    tokens: list[int] = []
    at_failover, end = -1, ""
    try:
        async for delta in c.stream(prompt, max_tokens=N_TOKENS, ignore_eos=True, deadline_s=DEADLINE_S):
            if failing.is_set() and at_failover < 0:
                at_failover = len(tokens)
            tokens += delta.token_ids
            progress[prompt] = len(tokens)
            end = delta.finish_reason or end
    except sdk.NightjarError as exc:
        end = exc
    return tokens, at_failover, end


async def _streams_through(stack: Stack, fail_over: Callable[[], None]):
    """Reference tokens of each prompt alone, then all of them streamed at once with
    ``fail_over()`` run (to its end: the new primary in place) once each has ``STARTED``
    tokens; then one new request after it.
    Returns (reference, [(tokens, at_failover, end)], the new request's tokens)."""
    async with AsyncClient(stack.address) as c:
        reference = {p: list((await c.generate(p, max_tokens=N_TOKENS, ignore_eos=True, deadline_s=120)).token_ids)
                     for p in PROMPTS}
    progress = dict.fromkeys(PROMPTS, 0)
    failing = asyncio.Event()
    async with AsyncClient(stack.address, retry=NO_RETRY) as c:  # no SDK retry: the stream itself must survive
        tasks = [asyncio.create_task(_collect(c, p, progress, failing)) for p in PROMPTS]
        while min(progress.values()) < STARTED:
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        failing.set()
        await asyncio.to_thread(fail_over)
        results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S + 30)
    async with AsyncClient(stack.address) as c:
        try:
            after = list((await c.generate(PROMPTS[0], max_tokens=N_TOKENS, ignore_eos=True, deadline_s=60)).token_ids)
        except sdk.NightjarError as exc:  # what each service saw is the only clue to why
            raise AssertionError(f"the request after it failed: {exc!r}\n{_logs(stack, tail=3000)}") from exc
    return reference, results, after


def _logs(stack: Stack, tail: int | None = None) -> str:
    """Every service's log (with ``tail``, its last ``tail`` characters, under its name)."""
    if tail is None:
        return "\n".join(svc.log_path.read_text(errors="replace") for svc in stack.services)
    return "\n".join(f"== {svc.log_path.name}\n{svc.log_path.read_text(errors='replace')[-tail:]}" for svc in stack.services)


@pytest.mark.slow
async def test_streams_survive_a_manual_failover_of_their_primary(replicated):
    """``CLUSTER FAILOVER`` on the replica: the primary stops taking writes, the replica catches
    up with every one, they swap. Nothing is lost: every stream completes with the tokens of an
    uninterrupted run, and a new request is served by the new primary."""
    cluster = replicated
    with _stack(cluster) as stack:
        key = Keys(stack.cfg.key_prefix).policy
        primary = cluster.owner(key)
        replica = cluster.replica_of(primary)
        reference, results, after = await _streams_through(stack, lambda: cluster.fail_over(replica, key))
        assert cluster.owner(key) == replica
        role = cluster.role(primary)  # the old primary now replicates the new one
        assert role[0] == b"slave" and int(role[2]) == replica, role
        assert not dead_services(stack)
        logs = _logs(stack)
    _assert_whole(results, reference, after, "the failover")
    # The gateway's reader, pinned to the old primary, was cut off with every stream in flight
    # (Redis 6.2 answers a blocked XREAD with UNBLOCKED when its node turns replica)
    # and re-pinned to the new one.
    assert f"{len(PROMPTS)} streams continue" in logs, logs[-4000:]
    assert "Traceback" not in logs, logs[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("takeover", [True, False], ids=["takeover", "automatic"])
async def test_streams_across_a_killed_primary(replicated, takeover):
    """SIGKILL of the slot's primary, then ``CLUSTER FAILOVER TAKEOVER`` on its replica, or
    (automatic) nothing: the cluster elects the replica after ``cluster-node-timeout``, a few
    seconds, under the gateway's ``--redis-outage-s`` (10 s). Replication is asynchronous, so
    writes the replica had not received are gone (the dead primary's AOF cannot help: the
    cluster moved on without it). A stream that lost some fails UNAVAILABLE (a gap) or
    DEADLINE_EXCEEDED (its job or final chunk), never with a hole or a wrong token; every other
    completes exactly (on loopback, usually all of them); new requests are served."""
    cluster = replicated
    with _stack(cluster) as stack:
        key = Keys(stack.cfg.key_prefix).policy
        primary = cluster.owner(key)
        replica = cluster.replica_of(primary)

        def kill_and_fail_over() -> None:
            cluster.kill(primary)
            if takeover:
                cluster.fail_over(replica, key, takeover=True)
            else:
                cluster.wait_promoted(replica, key, timeout_s=60)

        reference, results, after = await _streams_through(stack, kill_and_fail_over)
        assert cluster.owner(key) == replica and primary not in cluster.live()
        assert not dead_services(stack)
        logs = _logs(stack)
    for prompt, (tokens, at_failover, end) in zip(PROMPTS, results):
        if end == "length":
            assert len(tokens) == N_TOKENS and 0 < at_failover < N_TOKENS, (prompt, len(tokens), at_failover)
            assert_same_greedy(prompt, tokens, reference[prompt], N_TOKENS)
        else:  # lost with the primary's last writes: failed loudly, and what did arrive is right
            assert isinstance(end, (sdk.Unavailable, sdk.DeadlineExceeded)), (prompt, repr(end))
            assert_same_greedy(prompt, tokens, reference[prompt][:len(tokens)], len(tokens))
    assert len(after) == N_TOKENS  # a request after the failover is served like one before it
    assert_same_greedy(PROMPTS[0], after, reference[PROMPTS[0]], N_TOKENS)
    assert "Traceback" not in logs, logs[-4000:]


@pytest.mark.slow
async def test_streams_follow_their_slot_resharded_mid_stream(replicated):
    """The slot moves to another primary while the streams run: while keys move a command may
    meet ASK or TRYAGAIN (a multi-key command whose keys are half moved), then MOVED; every
    stream completes exactly and nothing is left on the old primary."""
    cluster = replicated
    with _stack(cluster) as stack:
        keys = Keys(stack.cfg.key_prefix)
        before = cluster.owner(keys.policy)
        after = next(p for p in cluster.live() if p != before and cluster.role(p)[0] == b"master")
        reference, results, later = await _streams_through(
            stack, lambda: cluster.move_slot(cluster.slot(keys.policy), before, after))
        assert all(cluster.owner(keys.policy, p) == after for p in cluster.live())
        assert not cluster.ask_node(before, "CLUSTER COUNTKEYSINSLOT", cluster.slot(keys.policy))
        assert not dead_services(stack)
        logs = _logs(stack)
    _assert_whole(results, reference, later, "the reshard")
    assert "Traceback" not in logs, logs[-4000:]
