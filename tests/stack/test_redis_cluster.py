"""Redis Cluster (issue 21): every key a script or transaction touches is declared and in one slot.

Cluster routes a command by its keys and refuses one whose keys live in different slots, while our
Lua scripts, the gateway's one XREAD and the scheduler's MULTI blocks each touch many keys. So a
stack's keys share one slot (a hash-tag prefix such as ``{nj}``) and every script declares its keys
in KEYS. The slow tests run on a real cluster (``cluster``, tests/redis_cluster.py), up to a whole
stack on a ``redis+cluster://`` URL following its slot to another node (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from nightjar import dispatch_lease
from nightjar.dispatch_lease import DirectDispatch, lease_entry
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, Job, Policy
from nightjar.service_util import (
    SlotNode,
    check_redis_url,
    connect_redis,
    connect_redis_sync,
    is_cluster_url,
    masked,
    node_url,
    now_ms,
)
from nightjar_client import AsyncClient
from nightjar_tools.redis_server import free_port
from nightjar_tools.stack import Stack, StackConfig
from scheduler_svc.config import SchedulerConfig
from tests.conftest import pair
from worker.service import redis_ops

SCRIPTS = {"lease": dispatch_lease._ENQUEUE, "write outputs": redis_ops._WRITE_OUTPUTS,
           "release assignment": redis_ops.RELEASE_ASSIGNMENT}


def test_every_key_a_script_touches_comes_from_keys():
    """Cluster (and Redis 7's script flags) require declared keys: no script may build a key
    name from ARGV or from a value it read."""
    for name, source in SCRIPTS.items():
        calls = re.findall(r"redis\.call\('(\w+)',\s*([^,)]+)", source)
        assert calls, name
        built = [(cmd, key) for cmd, key in calls if not re.fullmatch(r"KEYS\[[^\]]+\]", key.strip())]
        assert not built, f"{name}: keys not taken from KEYS: {built}"


def test_a_hash_tag_prefix_is_accepted_and_a_broken_one_refused():
    assert Keys("{nj}").slot_tag == "nj" and Keys("nj").slot_tag is None
    assert Keys("{nj}").inbox("w1") == "{nj}:inbox:w1"
    for bad in ("{}", "{nj", "nj}", "a{nj}", "{n}{j}"):
        with pytest.raises(ValueError, match="hash tag"):
            Keys(bad)


def test_a_cluster_url_names_seed_nodes_and_needs_a_tagged_prefix():
    assert is_cluster_url("redis+cluster://h:1") and is_cluster_url("rediss+cluster://h:1")
    assert not is_cluster_url("redis://h:1/0")
    assert check_redis_url("redis+cluster://:pw@a:7000,b:7001/0", "{nj}")
    assert node_url("rediss+cluster://u:pw@a:7000,b:7001/0?ssl_cert_reqs=none", "c", 7002) == \
        "rediss://u:pw@c:7002/0?ssl_cert_reqs=none"
    assert masked("redis+cluster://:secret@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    with pytest.raises(ValueError, match="hash tag"):
        check_redis_url("redis+cluster://a:7000", "nj")
    with pytest.raises(ValueError, match="hash tag"):
        SchedulerConfig(redis_url="redis+cluster://a:7000", key_prefix="nj")
    with pytest.raises(ValueError, match="host:port"):
        check_redis_url("redis+cluster://a/0")
    with pytest.raises(ValueError, match="database 0"):
        check_redis_url("redis+cluster://a:7000/2")
    with pytest.raises(ValueError) as err:
        check_redis_url("redis+cluster://:secret@a")
    assert "secret" not in str(err.value)  # the password never shows in the error


# --------------------------------------------------------------------------- a real cluster
# (the session's `cluster` fixture: tests/conftest.py, tests/redis_cluster.py)


async def beat(r, keys, wid, kv_free=100, running=0, draining=False):
    hb = Heartbeat(worker_id=wid, unix_ms=now_ms(), model="m", kv_blocks_free=kv_free, kv_blocks_total=100,
                   running=running, waiting=0, max_running=8, gamma=0, draft_residency="none", draining=draining)
    await r.set(keys.heartbeat(wid), hb.encode(), px=60_000)
    await r.hset(keys.leases, wid, lease_entry(hb))  # the scheduler's table row (scheduler_svc.capacity)
    await r.pexpire(keys.leases, 60_000)
    return hb


async def send(direct, rid) -> str | None:
    raw = Job(request_id=rid, prompt_token_ids=(1, 2, 3), params={"max_tokens": 4}).encode()
    return await direct.enqueue(rid, raw, now_ms())


@pytest.mark.slow
async def test_the_lease_script_runs_on_a_cluster(cluster):
    r = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
    try:
        keys = Keys(f"{{c{uuid.uuid4().hex[:6]}}}")
        direct = DirectDispatch(r, keys, assignment_ttl_s=60.0)
        assert await send(direct, "r0") is None  # no lease table: the requests stream
        assert await r.xlen(keys.requests) == 1
        await r.delete(keys.requests)
        await beat(r, keys, "w1")
        await beat(r, keys, "w2")
        assert [await send(direct, f"r{i}") for i in range(1, 5)] == ["w2", "w1", "w2", "w1"]
        assert [Job.decode(f[b"job"]).request_id for _, f in await r.xrange(keys.inbox("w2"))] == ["r1", "r3"]
        assert await r.hget(keys.assignment("r1"), "worker") == b"w2"
        assert await r.smembers(keys.worker_assignments("w1")) == {b"r2", b"r4"}
        # A worker that joins the table after the gateway declared its keys is seen at once
        # (the script names the undeclared workers; the caller declares them and calls again).
        await beat(r, keys, "w3")
        assert await send(direct, "r5") == "w3"
        await beat(r, keys, "w3", draining=True)
        assert await send(direct, "r6") != "w3"
        slots = {int(await r.execute_command("CLUSTER KEYSLOT", k, target_nodes=RedisCluster.RANDOM))
                 for k in (keys.requests, keys.leases, keys.assignment("r1"), keys.inbox("w1"), keys.heartbeat("w3"))}
        assert len(slots) == 1
    finally:
        await r.aclose()


@pytest.mark.slow
async def test_an_untagged_prefix_is_refused_by_the_cluster_not_misrouted(cluster):
    r = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
    try:
        keys = Keys(f"c{uuid.uuid4().hex[:6]}")
        await beat(r, keys, "w1")
        with pytest.raises((redis.RedisError, redis.exceptions.RedisClusterException), match="(?i)slot"):
            await send(DirectDispatch(r, keys, assignment_ttl_s=60.0), "r0")
    finally:
        await r.aclose()


@pytest.mark.slow
async def test_every_key_of_a_running_stack_is_in_one_slot(cluster):
    """A whole stack (gateway, scheduler, planner, worker) with a tagged prefix, mid-request:
    every key it made, per-request ones included, hashes to one Cluster slot."""
    target, draft = pair()
    prefix = f"{{c{uuid.uuid4().hex[:6]}}}"
    cfg = StackConfig(port=0, workers=1, key_prefix=prefix, target_path=Path(target), draft_path=Path(draft),
                      policy="fixed:2", worker_threads=1)
    seen: set[bytes] = set()
    with Stack(cfg) as stack:
        r = redis.Redis.from_url(stack.redis_url)
        async with AsyncClient(stack.address) as c:
            stream = c.stream("The old lighthouse keeper", max_tokens=64, ignore_eos=True, deadline_s=60)
            async for _ in stream:
                seen |= set(r.scan_iter(match=f"{prefix}:*", count=1000))
        await asyncio.sleep(1.0)  # stats, policy
        seen |= set(r.scan_iter(match=f"{prefix}:*", count=1000))
        r.close()
    kinds = {k[len(prefix) + 1:].split(b":", 1)[0] for k in seen}
    assert {b"requests", b"leases", b"hb", b"inbox", b"out", b"assign", b"worker_jobs", b"stats"} <= kinds, kinds
    node = redis.Redis(port=cluster.ports[0])
    slots = {node.execute_command("CLUSTER KEYSLOT", k) for k in seen}
    assert len(slots) == 1, slots
    # Without the tag the same names spread over the cluster: the tag is what holds them together.
    assert len({node.execute_command("CLUSTER KEYSLOT", k.replace(b"{", b"").replace(b"}", b"")) for k in seen}) > 1
    node.close()


@pytest.mark.slow
async def test_the_services_clients_reach_a_cluster_past_a_dead_seed(cluster):
    """connect_redis / connect_redis_sync with a cluster URL whose first seed is down; SlotNode
    puts the reader's two connections on the primary that owns the slot."""
    prefix = f"{{c{uuid.uuid4().hex[:6]}}}"
    keys = Keys(prefix)
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{cluster.ports[1]}"
    r = connect_redis(url, timeout_s=1.0)
    pin = SlotNode(url, r, keys.data_mark, timeout_s=1.0, block_margin_s=5.0)
    try:
        assert await r.set(keys.data_mark, b"m") and await r.get(keys.data_mark) == b"m"
        reader, control = await pin.clients()
        assert reader.connection_pool.connection_kwargs["port"] == cluster.owner(keys.data_mark)
        assert await control.get(keys.data_mark) == b"m"  # no MOVED: it is the owner
        # CLIENT UNBLOCK from the control connection ends the reader's blocking XREAD at once.
        rid = int(await reader.client_id())
        read = asyncio.ensure_future(reader.xread({keys.output("x"): b"0-0"}, block=10_000))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        assert await control.client_unblock(rid)
        assert await read in (None, [], {}) and time.monotonic() - started < 2.0
        assert (await pin.clients())[0] is reader  # the same node: the same clients
        sync = connect_redis_sync(url, socket_timeout=2)
        assert sync.get(keys.data_mark) == b"m"
        sync.close()
    finally:
        await pin.aclose()
        await r.delete(keys.data_mark)
        await r.aclose()


def _wait_async(check, what: str, timeout_s: float = 30.0):
    async def run():
        deadline = time.monotonic() + timeout_s
        while True:
            got = check()
            if got:
                return got
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.2)

    return run()


@pytest.mark.slow
async def test_a_whole_stack_runs_on_a_cluster(cluster):
    """Gateway, scheduler, planner and worker on a real 3-node cluster through a
    ``redis+cluster://`` URL whose one seed node does not own the stack's slot: the cluster
    client finds the owner (MOVED), the gateway's reader pins its XREAD and CLIENT UNBLOCK to
    that owner, and the planner's policy reaches the worker over Cluster pub/sub."""
    prefix = f"{{c{uuid.uuid4().hex[:6]}}}"
    keys = Keys(prefix)
    owner = cluster.owner(keys.policy)
    seed = next(p for p in cluster.ports if p != owner)
    cfg = StackConfig(port=0, workers=1, key_prefix=prefix, redis_url=f"redis+cluster://127.0.0.1:{seed}",
                      worker_threads=1)  # the shipped default models and policy
    with Stack(cfg) as stack:
        async with AsyncClient(stack.address) as c:
            async def one(i: int) -> list[int]:
                toks: list[int] = []
                async for delta in c.stream(f"{i}: The old lighthouse keeper", max_tokens=24, ignore_eos=True,
                                            deadline_s=120):
                    toks += delta.token_ids
                return toks

            # Concurrent streams: the later ones register while the reader's XREAD blocks, so
            # they are taken in only through CLIENT UNBLOCK on the owner node.
            results = await asyncio.gather(*(one(i) for i in range(3)))
        assert [len(t) for t in results] == [24, 24, 24]

        rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", seed)])
        on_owner = redis.Redis(port=owner)
        try:
            policy = Policy.decode(await _wait_async(lambda: on_owner.get(keys.policy), "the planner's policy"))
            (wid,) = [w.decode() for w in on_owner.smembers(keys.workers)]
            hb = Heartbeat.decode(on_owner.get(keys.heartbeat(wid)))
            assert hb.worker_id == wid and on_owner.exists(keys.leases)
            # The same key, routed: the planner may publish again between the two reads, so the
            # routed read sees this version or a later one of the same epoch.
            routed = Policy.decode(await rc.get(keys.policy))
            assert routed.epoch == policy.epoch and routed.version >= policy.version
            # Every key of the stack lives on the owner node, none elsewhere.
            for port in cluster.ports:
                node = redis.Redis(port=port)
                found = list(node.scan_iter(match=f"{prefix}:*", count=1000))
                node.close()
                assert bool(found) == (port == owner), (port, owner, found)
            # A policy published on another node reaches the worker (Cluster forwards PUBLISH
            # to every node; the worker follows the channel through the cluster client).
            newer = Policy(version=policy.version + 1000, unix_ms=now_ms(), ttl_s=600.0,
                           bucket_upper_bounds=policy.bucket_upper_bounds,
                           gamma_by_bucket=policy.gamma_by_bucket, residency=policy.residency, name=policy.name,
                           epoch=policy.epoch)
            elsewhere = redis.Redis(port=seed)
            assert elsewhere.publish(keys.policy_channel, newer.encode()) >= 0
            elsewhere.close()
            await _wait_async(lambda: Heartbeat.decode(on_owner.get(keys.heartbeat(wid))).policy_version == newer.version,
                              "the worker to apply the policy published on another node")
        finally:
            await rc.aclose()
            on_owner.close()
        logs = "\n".join(svc.log_path.read_text(errors="replace") for svc in stack.services)
    for bad in ("Traceback", "MOVED", "CROSSSLOT", "Redis failed"):
        assert bad not in logs, f"{bad!r} in the services' logs:\n{logs[-4000:]}"


@pytest.mark.slow
async def test_a_stack_follows_its_slot_to_another_node(cluster):
    """The stack's slot is resharded to another primary between two requests: every service
    follows it (MOVED; the gateway's reader asks where the slot is after the error) and the
    second request streams every token from the new owner."""
    prefix = f"{{c{uuid.uuid4().hex[:6]}}}"
    keys = Keys(prefix)
    before = cluster.owner(keys.policy)
    after = next(p for p in cluster.ports if p != before)
    cfg = StackConfig(port=0, workers=1, key_prefix=prefix, worker_threads=1,
                      redis_url=cluster.url)
    with Stack(cfg) as stack:
        async with AsyncClient(stack.address) as c:
            async def one(text: str) -> list[int]:
                toks: list[int] = []
                async for delta in c.stream(text, max_tokens=16, ignore_eos=True, deadline_s=120):
                    toks += delta.token_ids
                return toks

            assert len(await one("The old lighthouse keeper")) == 16
            slot = int(redis.Redis(port=before).execute_command("CLUSTER KEYSLOT", keys.policy))
            cluster.move_slot(slot, before, after)
            assert cluster.owner(keys.policy) == after
            assert len(await one("The old lighthouse keeper")) == 16
            await asyncio.sleep(1.0)  # heartbeats, stats and policy written since the move
            assert len(await one("A second request")) == 16
        old, new = redis.Redis(port=before), redis.Redis(port=after)
        try:
            assert not list(old.scan_iter(match=f"{prefix}:*", count=1000))
            assert new.exists(keys.policy) and new.exists(keys.leases)
            assert all(Heartbeat.decode(new.get(keys.heartbeat(w.decode()))) for w in new.smembers(keys.workers))
        finally:
            old.close()
            new.close()
        logs = "\n".join(svc.log_path.read_text(errors="replace") for svc in stack.services)
    assert "Traceback" not in logs, logs[-4000:]
