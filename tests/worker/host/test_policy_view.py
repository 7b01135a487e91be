"""worker.host.policy_view: the worker's local, TTL-guarded copy of the planner's policy."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from nightjar.keys import Keys
from nightjar.messages import Policy
from worker.host.policy_view import PolicyView, follow_policy

BOUNDS = (1, 2, 4, 8, 16, 32, 64)


def policy(version: int, gammas=(4, 4, 3, 2, 1, 0, 0), unix_s: float | None = None, ttl_s: float = 10.0,
           residency=None, epoch: str = "") -> Policy:
    return Policy(version=version, unix_ms=int((time.time() if unix_s is None else unix_s) * 1000), ttl_s=ttl_s,
                  bucket_upper_bounds=BOUNDS, gamma_by_bucket=gammas, residency=residency or {}, epoch=epoch)


def test_default_until_a_policy_arrives_then_the_table():
    view = PolicyView("w1", 2, ttl_s=5.0)
    now = time.time()
    assert view.version == -1 and view.gamma(1, now) == 2 and view.residency(now) == "resident"
    assert view.update(policy(3, residency={"w1": "offloaded", "w2": "resident"}))
    assert [view.gamma(b, now) for b in (1, 3, 8, 9, 17, 1000)] == [4, 3, 2, 1, 0, 0]
    assert view.residency(now) == "offloaded" and view.version == 3


def test_older_versions_are_ignored():
    view = PolicyView("w1", 0)
    view.update(policy(5, gammas=(1,) * 7))
    assert not view.update(policy(4, gammas=(3,) * 7)) and not view.update(policy(5, gammas=(3,) * 7))
    assert view.gamma(1, time.time()) == 1 and view.version == 5


def test_a_new_epoch_is_adopted_at_any_version_and_a_left_one_never_again():
    view = PolicyView("w1", 0)
    assert view.update(policy(500, gammas=(1,) * 7, epoch="a"))
    # The planner restarted from a fresh state (Redis came back empty): it counts from 1 again.
    assert view.update(policy(1, gammas=(3,) * 7, epoch="b"))
    assert view.epoch_version == ("b", 1) and view.gamma(1, time.time()) == 3
    assert not view.update(policy(501, gammas=(1,) * 7, epoch="a"))  # a late message of the epoch left
    assert not view.update(policy(1, gammas=(2,) * 7, epoch="b"))
    assert view.update(policy(2, gammas=(2,) * 7, epoch="b")) and view.gamma(1, time.time()) == 2


def test_a_policy_stamped_in_the_future_is_stale():
    view = PolicyView("w1", 1, ttl_s=None)
    now = time.time()
    view.update(policy(1, gammas=(4,) * 7, unix_s=now + 3600, residency={"w1": "offloaded"}))
    # Trusted until an hour past its TTL otherwise; NTP jitter (well under a second) is not this.
    assert view.gamma(1, now) == 1 and view.residency(now) == "resident" and not view.fresh(now)
    view.update(policy(2, gammas=(4,) * 7, unix_s=now + 0.2))
    assert view.gamma(1, now) == 4


def test_an_unknown_residency_is_logged_and_ignored(caplog):
    view = PolicyView("w1", 0)
    view.update(policy(1, residency={"w1": "evaporated", "w2": "offloaded"}))
    now = time.time()
    with caplog.at_level("WARNING", logger="worker.policy"):
        assert view.residency(now) == "resident" and view.residency(now) == "resident"
    assert [r.getMessage() for r in caplog.records if "evaporated" in r.getMessage()][:2] == [
        "policy v1: ignoring residency 'evaporated' for w1 (not one of ('resident', 'offloaded'))"]
    assert PolicyView("w2", 0).update(policy(1, residency={"w2": "offloaded"}))


def test_stale_policy_falls_back_to_default_and_resident():
    view = PolicyView("w1", lambda b: 3 if b < 8 else 0, ttl_s=None)
    now = time.time()
    view.update(policy(1, gammas=(1,) * 7, ttl_s=2.0, residency={"w1": "offloaded"}))
    assert view.gamma(4, now + 1.0) == 1 and view.residency(now + 1.0) == "offloaded"
    assert view.gamma(4, now + 3.0) == 3 and view.gamma(20, now + 3.0) == 0
    assert view.residency(now + 3.0) == "resident"  # a dead planner must not keep the draft away
    capped = PolicyView("w1", 0, ttl_s=0.5)  # the worker's own cap is tighter than the policy's
    capped.update(policy(1, gammas=(1,) * 7, ttl_s=10.0))
    assert capped.gamma(1, now + 0.2) == 1 and capped.gamma(1, now + 1.0) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="default_gamma"):
        PolicyView("w1", -1)
    with pytest.raises(ValueError, match="ttl_s"):
        PolicyView("w1", 0, ttl_s=0)


async def test_follow_loads_the_key_then_follows_the_channel(redis_url, key_prefix):
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_url)
    await r.set(keys.policy, policy(7).encode())
    view = PolicyView("w1", 0)
    stop = asyncio.Event()
    task = asyncio.create_task(follow_policy(r, keys, view, stop))
    for _ in range(100):
        if view.version == 7:
            break
        await asyncio.sleep(0.02)
    assert view.version == 7
    await r.publish(keys.policy_channel, b"\xc1 garbage")  # ignored, not fatal
    await r.publish(keys.policy_channel, policy(8, gammas=(0,) * 7).encode())
    for _ in range(100):
        if view.version == 8:
            break
        await asyncio.sleep(0.02)
    assert view.version == 8 and view.gamma(1, time.time()) == 0
    stop.set()
    await asyncio.wait_for(task, 5)
    await r.aclose()


async def test_follow_survives_a_redis_restart(key_prefix):
    from nightjar_tools.redis_server import EmbeddedRedis

    keys = Keys(key_prefix)
    server = EmbeddedRedis().start()
    port = server.port
    r = aioredis.Redis.from_url(server.url, socket_connect_timeout=0.5)
    view = PolicyView("w1", 0)
    stop = asyncio.Event()
    task = asyncio.create_task(follow_policy(r, keys, view, stop, retry_s=0.1))
    try:
        await asyncio.sleep(0.2)
        server.stop()
        await asyncio.sleep(0.3)
        server = EmbeddedRedis(port=port).start()
        await r.set(keys.policy, policy(11).encode())  # published while the follower was away
        for _ in range(100):
            if view.version == 11:
                break
            await asyncio.sleep(0.05)
        assert view.version == 11
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await r.aclose()
        server.stop()


async def test_follow_survives_a_transport_closed_while_resubscribing(redis_url, key_prefix):
    """redis-py reconnects a pub/sub connection inside get_message; when the node dies during
    that (a Cluster primary SIGKILLed), uvloop raises RuntimeError for the closed transport, not
    ConnectionError. The follower resubscribes as for any lost connection: that error used to
    end it, which stopped the worker."""
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_url)
    broken: list[bool] = []

    class OnceBroken:  # the client, whose first pub/sub connection fails the way uvloop's did
        def __getattr__(self, name):
            return getattr(r, name)

        def pubsub(self):
            ps = r.pubsub()
            if not broken:
                broken.append(True)

                async def closed_transport(**_kw):
                    raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

                ps.get_message = closed_transport
            return ps

    view = PolicyView("w1", 0)
    stop = asyncio.Event()
    task = asyncio.create_task(follow_policy(OnceBroken(), keys, view, stop, retry_s=0.05))
    try:
        for _ in range(100):
            await r.publish(keys.policy_channel, policy(9).encode())
            if view.version == 9 or task.done():
                break
            await asyncio.sleep(0.05)
        assert broken and not task.done(), task.exception() if task.done() else None
        assert view.version == 9
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await r.aclose()
