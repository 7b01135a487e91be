"""Shared pieces of the reliability tests: one hardened stack, restarts, process memory, Redis views.

The light reliability modules (bad input, Redis input, security) share one stack per pytest
process (``hardened_stack``): a password-protected embedded Redis, bearer auth on the gateway,
planner on, one worker. Starting a stack costs ~20 s on the shared 2-core box, so sharing it is
what keeps these modules within budget; each test leaves the stack as it found it (the tests
check exactly that).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from engine_support import pair
from pipeline_support import heartbeats  # noqa: F401 (re-exported for the reliability tests)
from nightjar import paths
from nightjar.keys import Keys
from nightjar.redis_server import EmbeddedRedis
from nightjar.stack import Service, Stack, StackConfig

TOKEN = "s3cret-token-for-tests"
REDIS_PASSWORD = "redis-pw-for-tests"


@functools.cache
def hardened_stack() -> Stack:
    """Auth on, Redis password on, planner on, one worker; stopped when the process exits."""
    server = EmbeddedRedis(password=REDIS_PASSWORD).start()
    atexit.register(server.stop)
    target, draft = pair()
    cfg = StackConfig(port=0, workers=1, redis_url=server.url, key_prefix=f"r{uuid.uuid4().hex[:8]}",
                      target_path=Path(target), draft_path=Path(draft), policy="fixed:2", worker_threads=1,
                      api_key=TOKEN)
    stack = Stack(cfg).start()
    atexit.register(stack.stop)
    return stack


def start_stack(workers: int = 1, **kw) -> Stack:
    """A stack with its own embedded Redis (so a test may restart that Redis)."""
    target, draft = pair()
    kw.setdefault("worker_threads", 1)
    if os.environ.get("NIGHTJAR_TEST_LOG_DIR"):  # keep the services' logs for a post-mortem
        kw.setdefault("log_dir", Path(os.environ["NIGHTJAR_TEST_LOG_DIR"]) / uuid.uuid4().hex[:6])
    cfg = StackConfig(port=0, workers=workers, key_prefix=f"f{uuid.uuid4().hex[:8]}", target_path=Path(target),
                      draft_path=Path(draft), **kw)
    return Stack(cfg).start()


def metadata() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKEN}"),)


def client(stack: Stack) -> redis.Redis:
    return redis.Redis.from_url(stack.redis_url, socket_connect_timeout=2, socket_timeout=5)


def keys(stack: Stack) -> Keys:
    return Keys(stack.cfg.key_prefix)


def kv_free(stack: Stack) -> int:
    return sum(h.kv_blocks_free for h in heartbeats(stack).values())


# Nothing in flight: every KV block free, nothing running, queued, unacknowledged or assigned.
# (An absolute target: a snapshot taken right after traffic may still show the last request.)
IDLE = {"kv_used": 0, "running": 0, "queued": 0, "inboxes": 0, "assigned": 0, "assignment_keys": 0}


def idle_state(stack: Stack) -> dict:
    """What must be back to its resting value once no request is in flight."""
    r, k = client(stack), keys(stack)
    try:
        beats = heartbeats(stack)
        inboxes = sum(r.xlen(k.inbox(w)) for w in beats)
        assigned = sum(r.scard(k.worker_assignments(w)) for w in beats)
        return {"kv_used": sum(h.kv_blocks_total - h.kv_blocks_free for h in beats.values()),
                "running": sum(h.running + h.waiting for h in beats.values()),
                "queued": r.xlen(k.requests), "inboxes": inboxes, "assigned": assigned,
                "assignment_keys": len(list(r.scan_iter(match=f"{k.prefix}:assign:*", count=1000)))}
    finally:
        r.close()


async def wait_idle(stack: Stack, baseline: dict, timeout_s: float = 20.0) -> dict:
    """Poll ``idle_state`` until it equals ``baseline``; returns the last state seen."""
    deadline = time.monotonic() + timeout_s
    state = idle_state(stack)
    while state != baseline and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        state = idle_state(stack)
    return state


PER_REQUEST_KINDS = (b"out", b"cancel", b"assign")  # keys named after one request (nightjar.keys)


def per_request_keys_without_ttl(stack: Stack) -> set[bytes]:
    """Per-request keys that would never expire: must always be empty."""
    prefix_len = len(stack.cfg.key_prefix) + 1
    return {k for k in keys_without_ttl(stack) if k[prefix_len:].split(b":", 1)[0] in PER_REQUEST_KINDS}


def keys_without_ttl(stack: Stack) -> set[bytes]:
    """Keys of this stack that never expire (per-request keys must all carry a TTL)."""
    r, k = client(stack), keys(stack)
    try:
        names = list(r.scan_iter(match=k.all_pattern, count=1000))
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
        return {n for n, ttl in zip(names, pipe.execute()) if ttl == -1}
    finally:
        r.close()


def respawn(stack: Stack, svc: Service) -> Service:
    """Start a dead service again with the same arguments (kept in ``stack.services`` for stop())."""
    assert not svc.alive(), "respawn only a dead service"
    log_path = svc.log_path.with_name(f"{svc.log_path.stem}-re{int(time.time() * 1000) % 100000}.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nightjar.cli", svc.name, *svc.args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=svc.env, cwd=str(paths.ROOT))
    new = Service(svc.name, list(svc.args), log_path, proc, svc.metrics_port, svc.env)
    stack.services.remove(svc)
    stack.services.append(new)
    return new





def command_lines_under(root_pid: int) -> dict[int, str]:
    """The command line (/proc/PID/cmdline, arguments joined by spaces) of every live
    descendant of ``root_pid`` (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, todo = {}, [root_pid]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                try:
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                todo.append(pid)
    return found


def dead_services(stack: Stack) -> list[str]:
    """The services that died, with their log tails (empty = all alive)."""
    return [f"{s.name} (rc {s.proc.returncode}):\n{s.log_tail(20)}" for s in stack.services if not s.alive()]


async def read_until_final(redis_client, keys: Keys, rid: str, timeout_s: float = 60.0) -> list:
    """Every OutputChunk of request ``rid`` up to its final one; a Redis error (a BUSY script,
    a restart) is waited out, not raised, until ``timeout_s``."""
    from nightjar.messages import OutputChunk

    chunks, last = [], b"0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = await redis_client.xread({keys.output(rid): last}, block=200)
        except redis.RedisError:
            await asyncio.sleep(0.2)
            continue
        for _, entries in reply or ():
            for entry_id, fields in entries:
                last = entry_id
                chunks.append(OutputChunk.decode(fields[b"c"]))
                if chunks[-1].finish_reason is not None:
                    return chunks
    raise AssertionError(f"{rid}: no final chunk within {timeout_s}s")
