"""Helpers for the tests that run the whole stack (nightjar_tools.stack.Stack) as child processes."""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import redis

from nightjar import paths
from nightjar.keys import Keys
from nightjar.messages import Heartbeat, SamplingParams
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_tools.redis_server import EmbeddedRedis
from nightjar_tools.stack import Service, Stack, StackConfig
from tests.conftest import (  # noqa: F401 (re-exported)
    PROMPTS,
    check_greedy,
    engine,
    hf_greedy,
    pair,
    read_until_final,
    run_all,
    tokenizer,
)


def prompt_texts(n: int, chars: int = 120) -> list[str]:
    """n held-out prompts, cut to ``chars`` characters (short prompts keep 2 cores fast)."""
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    out = [t[:chars] for t in texts if t.strip()][:n]
    assert len(out) == n, "models/prompts.jsonl has too few prompts"
    return out


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


def start_stack(workers: int = 1, redis_url: str | None = None, **kw) -> Stack:
    """A stack on ``redis_url``, or with its own embedded Redis (so a test may restart that Redis)."""
    target, draft = pair()
    kw.setdefault("worker_threads", 1)
    if os.environ.get("NIGHTJAR_TEST_LOG_DIR"):  # keep the services' logs for a post-mortem
        kw.setdefault("log_dir", Path(os.environ["NIGHTJAR_TEST_LOG_DIR"]) / uuid.uuid4().hex[:6])
    cfg = StackConfig(port=0, workers=workers, redis_url=redis_url, key_prefix=f"f{uuid.uuid4().hex[:8]}", target_path=Path(target),
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
        proc = subprocess.Popen([sys.executable, "-m", "nightjar_tools.cli", svc.name, *svc.args], stdout=log,
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


def busiest_worker(stack):
    """(service, assignments) of the worker holding the most unfinished requests right now."""
    keys = Keys(stack.cfg.key_prefix)
    r = redis.Redis.from_url(stack.redis_url)
    try:
        best = None
        for svc in stack.workers():
            wid = next((w.decode() for w in r.smembers(keys.workers) if f"-{svc.proc.pid}-" in w.decode()), None)
            n = r.scard(keys.worker_assignments(wid)) if wid else 0
            if best is None or n > best[1]:
                best = (svc, n)
        return best
    finally:
        r.close()
