"""The planner service against a real redis-server: stats in, versioned policy out, resume."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from nightjar import paths
from nightjar.keys import Keys
from nightjar.messages import Policy, PolicyHold, StepStats
from planner_svc.__main__ import parse_config
from planner_svc.config import PlannerConfig
from planner_svc.service import PlannerService
from worker.host.policy_view import PolicyView, follow_policy


def step(batch: int, gamma: int, accepted: tuple[int, ...] = (), worker: str = "w1") -> StepStats:
    return StepStats(worker_id=worker, step=1, unix_ms=int(time.time() * 1000), batch_size=batch, gamma=gamma,
                     draft_ms=0.8 * gamma, verify_ms=5.0 + 0.25 * batch * (gamma + 1), step_ms=6.0,
                     accepted_per_position=accepted, emitted_tokens=batch, kv_blocks_used=10, kv_blocks_free=90)


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def config(redis_url: str, prefix: str, policy: str = "nightjar", **kw) -> PlannerConfig:
    return PlannerConfig(redis_url=redis_url, key_prefix=prefix, policy=policy, consumer="p1", read_block_ms=20, **kw)


async def drain(service: PlannerService) -> None:
    for _ in range(50):
        was_pending = service._pending_first  # the first read re-reads our own unacked entries
        if await service.step_once(block_ms=10) == 0 and not was_pending:
            return


async def test_stats_in_policy_out(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix, "heuristic", gamma_max=4), r)
    await service.start()
    ps = r.pubsub()
    await ps.subscribe(keys.policy_channel)
    await service.publish(force=True)
    first = Policy.decode(await r.get(keys.policy))
    assert first.gamma_by_bucket == (4,) * 7 and first.version == 1 and first.name == "heuristic"
    for _ in range(3):  # heuristic: −1 per step without full acceptance
        await r.xadd(keys.stats, {b"s": step(4, 4, accepted=(2, 1, 0, 0)).encode()})
    await drain(service)
    latest = Policy.decode(await r.get(keys.policy))
    assert latest.version > first.version and latest.gamma_by_bucket == (1,) * 7  # same γ in every bucket
    assert latest.bucket_upper_bounds == (1, 2, 4, 8, 16, 32, 64) and latest.ttl_s == 10.0
    got = []
    for _ in range(20):
        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            got.append(Policy.decode(msg["data"]).version)
    assert got and got[-1] == latest.version
    pending = await r.xpending(keys.stats, keys.planner_group)
    assert pending["pending"] == 0 and service.processed == 3
    await ps.aclose()


async def test_bad_entries_are_acknowledged_and_skipped(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix), r)
    await service.start()
    await r.xadd(keys.stats, {b"s": b"\xc1 not msgpack"})
    await r.xadd(keys.stats, {b"other": b"x"})
    await r.xadd(keys.stats, {b"s": step(2, 1, accepted=(1,)).encode()})
    await drain(service)
    assert service.rejected == 2 and service.processed == 1
    assert (await r.xpending(keys.stats, keys.planner_group))["pending"] == 0


async def test_a_hold_publishes_a_static_policy_and_the_planner_resumes_unlearned(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix, "heuristic", gamma_max=4), r)
    await service.start()
    await service.publish(force=True)
    own = Policy.decode(await r.get(keys.policy))
    await r.set(keys.planner_hold, PolicyHold("fixed:1", reason="test").encode(), px=60_000)
    await asyncio.sleep(0.25)  # the planner reads the hold key every HOLD_CHECK_S
    await service.step_once(block_ms=10)
    held = Policy.decode(await r.get(keys.policy))
    assert held.name == "hold:fixed:1" and held.gamma_by_bucket == (1,) * 7
    assert held.epoch == own.epoch and held.version > own.version
    for _ in range(3):  # would take the heuristic's γ from 4 to 1, were it learned
        await r.xadd(keys.stats, {b"s": step(4, 1, accepted=(0,)).encode()})
    await drain(service)
    assert service.held_steps == 3 and service.policy.table() == (4,) * 7
    late = step(4, 1, accepted=(0,))  # ran under the hold, read after it lifted
    await r.delete(keys.planner_hold)
    await asyncio.sleep(0.002)
    await service.check_hold()
    back = Policy.decode(await r.get(keys.policy))
    assert back.name == "heuristic" and back.gamma_by_bucket == (4,) * 7 and back.version > held.version
    await r.xadd(keys.stats, {b"s": late.encode()})
    await drain(service)
    assert service.held_steps == 4 and service.policy.table() == (4,) * 7
    await r.xadd(keys.stats, {b"s": step(4, 4, accepted=(2, 1, 0, 0)).encode()})
    await drain(service)
    assert service.policy.table() == (3,) * 7  # learning again


@pytest.mark.parametrize("raw", [PolicyHold("ucb").encode(), PolicyHold("fixed:9").encode(), b"\xc1 not msgpack"])
async def test_a_hold_that_is_not_a_static_policy_is_ignored(r, redis_url, key_prefix, raw):
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix, "fixed:2", gamma_max=4), r)
    await service.start()
    await r.set(keys.planner_hold, PolicyHold("off").encode())
    await service.check_hold()
    assert Policy.decode(await r.get(keys.policy)).name == "hold:off"
    await r.set(keys.planner_hold, raw)  # a bad replacement lifts the hold it replaced
    await service.check_hold()
    now = Policy.decode(await r.get(keys.policy))
    assert service.hold is None and now.name == "fixed:2" and now.gamma_by_bucket == (2,) * 7


async def test_restart_resumes_state_and_version(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    cfg = config(redis_url, key_prefix)
    first = PlannerService(cfg, r)
    await first.start()
    for i in range(300):
        b = 1 + i % 24
        g = first.policy.gamma_for(b)
        await r.xadd(keys.stats, {b"s": step(b, g, accepted=tuple(range(b, 0, -max(1, b // 3)))[:g]).encode()})
    await drain(first)
    await first.publish(force=True)
    await first.save_state()
    table, version = first.policy.table(), first.version
    second = PlannerService(cfg, r)
    await second.start()
    assert second.policy.updates == first.policy.updates == 300
    assert second.policy.table() == table
    await second.publish(force=True)
    assert second.version > version and Policy.decode(await r.get(keys.policy)).version == second.version
    # a different policy spec starts fresh but still never reuses a version
    other = PlannerService(config(redis_url, key_prefix, "fixed:2"), r)
    await other.start()
    await other.publish(force=True)
    assert other.version > second.version and other.policy.table() == (2,) * 7


async def test_run_loop_publishes_refreshes_and_stops(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix, "ucb", ttl_s=0.6), r)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await r.xadd(keys.stats, {b"s": step(8, 4, accepted=(8, 8, 8, 8)).encode()})
    deadline = time.monotonic() + 5
    versions = set()
    while time.monotonic() < deadline and len(versions) < 3:  # unchanged policy is re-sent every ttl/3
        blob = await r.get(keys.policy)
        if blob:
            versions.add(Policy.decode(blob).version)
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert len(versions) >= 3 and service.processed == 1
    assert await r.get(keys.planner_state)  # saved on the way out


async def test_stale_policy_falls_back_to_worker_default(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    view = PolicyView("w1", default_gamma=lambda b: 2 if b <= 8 else 0, ttl_s=None)
    stop = asyncio.Event()
    follower = asyncio.create_task(follow_policy(r, keys, view, stop))
    service = PlannerService(config(redis_url, key_prefix, "fixed:4", ttl_s=1.0), r)
    await service.start()
    await asyncio.sleep(0.2)  # let the follower subscribe
    await service.publish(force=True)
    for _ in range(50):
        if view.version == service.version:
            break
        await asyncio.sleep(0.05)
    now = time.time()
    assert view.version == service.version and view.gamma(3, now) == 4 and view.gamma(40, now) == 4
    assert view.gamma(3, now + 2.0) == 2 and view.gamma(40, now + 2.0) == 0  # older than its 1 s TTL
    stop.set()
    await asyncio.wait_for(follower, 5)


def test_cli_rejects_bad_input_and_builds_a_config(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--policy", "bogus"])
    assert "unknown policy spec" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--ttl-s", "0"])
    cfg = parse_config(["--policy", "table:1=4,16=0", "--gamma-max", "6", "--redis-url", "redis://h:1/0"])
    assert cfg.policy == "table:1=4,16=0" and cfg.gamma_max == 6 and cfg.republish_s == pytest.approx(10 / 3)
    assert cfg.prior_surface is None and cfg.surface_prior() is None  # no prior unless asked


def test_cli_takes_a_prior_surface_by_shipped_name_or_path(capsys):
    by_name = parse_config(["--prior-surface", "cpu_tiny"])
    assert Path(by_name.prior_surface) == paths.COST_SURFACES / "cpu_tiny.json" and by_name.surface_prior() is not None
    by_path = parse_config(["--prior-surface", str(paths.COST_SURFACES / "cpu_serve.json")])
    assert by_path.surface_prior() is not None
    assert parse_config(["--prior-surface", "none"]).prior_surface is None
    with pytest.raises(SystemExit):
        parse_config(["--prior-surface", "cpu_nonesuch"])
    assert "cpu_nonesuch" in capsys.readouterr().err


async def test_corrupt_saved_state_starts_fresh(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    await r.set(keys.planner_state, b"\xc1 not msgpack")
    service = PlannerService(config(redis_url, key_prefix), r)
    await service.start()
    assert service.version == 0 and service.policy.updates == 0
    await service.publish(force=True)
    assert Policy.decode(await r.get(keys.policy)).version == 1


async def test_a_version_near_2_64_starts_a_new_epoch_instead_of_crash_looping(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    view = PolicyView("w1", 0)
    huge = Policy(version=2**64 - 1, unix_ms=int(time.time() * 1000), ttl_s=10.0, bucket_upper_bounds=(1,),
                  gamma_by_bucket=(1,), epoch="old")
    await r.set(keys.policy, huge.encode())
    view.update(huge)
    for _ in range(2):  # a restart finds the same published version: it must not fail again
        service = PlannerService(config(redis_url, key_prefix, "fixed:3"), r)
        await service.start()
        await service.publish(force=True)
        published = Policy.decode(await r.get(keys.policy))
        assert published.version == 1 and published.epoch not in ("", "old")
        assert view.update(published) and view.gamma(1, time.time()) == 3  # workers follow the new epoch
        await r.set(keys.policy, huge.encode())


async def test_a_fresh_state_gets_a_new_epoch_and_a_resumed_one_keeps_it(r, redis_url, key_prefix):
    keys = Keys(key_prefix)
    first = PlannerService(config(redis_url, key_prefix, "fixed:2"), r)
    await first.start()
    await first.publish(force=True)
    await first.save_state()
    resumed = PlannerService(config(redis_url, key_prefix, "fixed:2"), r)
    await resumed.start()
    assert resumed.epoch == first.epoch
    await r.delete(keys.planner_state, keys.policy)  # Redis came back empty
    fresh = PlannerService(config(redis_url, key_prefix, "fixed:2"), r)
    await fresh.start()
    await fresh.publish(force=True)
    assert fresh.epoch != first.epoch and fresh.version == 1
    view = PolicyView("w1", 0)
    view.update(first.published_policy)
    assert view.update(fresh.published_policy)  # not ignored for being version 1


async def test_run_loop_reads_stats_in_batches_while_they_flow(r, redis_url, key_prefix):
    # An engine step every ~5 ms must not cost the planner a round trip each: it reads at most
    # once per read_interval_ms, and every entry is still learned from.
    keys = Keys(key_prefix)
    service = PlannerService(config(redis_url, key_prefix, "nightjar", read_interval_ms=100), r)
    reads = 0
    step_once = service.step_once

    async def counted(block_ms=None):
        nonlocal reads
        reads += 1
        return await step_once(block_ms)

    service.step_once = counted
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    t0 = time.monotonic()
    for _ in range(100):
        await r.xadd(keys.stats, {b"s": step(4, 2, accepted=(4, 3)).encode()})
        await asyncio.sleep(0.005)
    elapsed = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while service.processed < 100 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert service.processed == 100
    assert reads <= elapsed / 0.1 + 6, (reads, elapsed)  # one per interval, plus the block and drain reads


def test_read_interval_is_validated():
    with pytest.raises(ValueError, match="read_interval_ms"):
        PlannerConfig(read_interval_ms=-1)
