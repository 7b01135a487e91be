"""The load generator: an async gRPC driver over the raw ``nightjar.v1`` stubs.

Open loop unless the workload is closed: each request leaves at its planned arrival time whether
or not earlier ones finished, so a saturated server shows up as queueing, not as a slower client.
The generator's own overhead is measured, not assumed (the report's ``send_lag_s``). How a run
is bounded and sampled: ``run_load``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
import grpc.aio

from nightjar_tools.bench.workload import Workload
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc

Probe = Callable[[], Awaitable[dict]]


@dataclass(frozen=True)
class LoadConfig:
    target: str  # gateway address, host:port
    max_duration_s: float = 120.0  # no arrival is sent after this
    drain_timeout_s: float = 60.0  # after the last arrival, wait this long, then cancel the rest
    request_timeout_s: float = 600.0  # gRPC deadline per request
    sample_interval_s: float = 0.5
    max_in_flight: int = 1024  # a safety valve for the client, far above what the stack can hold
    temperature: float = 0.0  # greedy: the same run gives the same tokens under every policy
    seed: int = 0
    progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"target must be host:port, got {self.target!r}")
        for name in ("max_duration_s", "drain_timeout_s", "request_timeout_s", "sample_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass
class RequestRecord:
    index: int
    planned_s: float  # from the run's start
    prompt_tokens_planned: int
    max_tokens: int
    sent_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0  # the gateway's count
    completion_tokens: int = 0
    chunks: int = 0
    status: str = "pending"  # ok | cancelled | <grpc status name>
    error: str = ""
    server_ttft_ms: float = 0.0
    server_e2e_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def itl_s(self) -> float | None:
        """Mean time per output token after the first (TPOT)."""
        if self.end_s is None or self.first_token_s is None or self.completion_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.completion_tokens - 1)


@dataclass
class LoadResult:
    label: str
    workload: str
    started_unix: float
    wall_s: float
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)


class _Counters:
    """Client-side counters the sampler turns into rates (owned by the event loop)."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_flight = 0
        self.tokens = 0
        self.finished: list[RequestRecord] = []


async def run_load(workload: Workload, prompts: list[str], cfg: LoadConfig, probe: Probe | None = None,
                   channel: grpc.aio.Channel | None = None) -> LoadResult:
    """Replay ``workload`` (with ``prompts[i]`` as request i's text) against ``cfg.target``.

    Each request is sent at its planned arrival time; a closed-loop workload (``Workload.clients``)
    instead keeps that many requests in flight, each client sending its next as soon as its last
    one finished, until ``Workload.duration_s``. A run is bounded in count (the workload) and in
    time (``max_duration_s`` for arrivals, then ``drain_timeout_s`` for the stragglers, which are
    cancelled). Every ``sample_interval_s`` a sampler records the client's view (offered load, in
    flight, tokens/s, latency of what just finished) merged with whatever the optional ``probe``
    returns (the stack's heartbeats and step statistics). The report's ``send_lag_s`` is how late
    each request left relative to its plan; it grows if the client (not the server) is the bottleneck.
    """
    if len(prompts) != len(workload):
        raise ValueError(f"need one prompt per request: {len(prompts)} prompts for {len(workload)} requests")
    own_channel = channel is None
    if own_channel:
        channel = grpc.aio.insecure_channel(cfg.target)  # one HTTP/2 connection: every request a stream on it
    stub = pb_grpc.InferenceServiceStub(channel)
    records = [RequestRecord(i, float(t), int(p), int(o)) for i, (t, p, o) in
               enumerate(zip(workload.arrival_s, workload.prompt_tokens, workload.output_tokens))]
    counters = _Counters()
    samples: list[dict] = []
    gate = asyncio.Semaphore(cfg.max_in_flight)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    started_unix = time.time()
    run_id = uuid.uuid4().hex[:8]  # request ids stay unique across runs on one stack
    stop_sampling = asyncio.Event()
    to_send = sum(r.planned_s <= cfg.max_duration_s for r in records)
    progress = _Progress(cfg.label, to_send) if cfg.progress else None

    async def one(rec: RequestRecord, prompt: str) -> None:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=rec.max_tokens, temperature=cfg.temperature,
                                 seed=cfg.seed + rec.index, ignore_eos=True, request_id=f"bench-{run_id}-{rec.index}")
        async with gate:
            counters.in_flight += 1
            rec.sent_s = loop.time() - t0
            try:
                call = stub.Generate(req, timeout=cfg.request_timeout_s)
                async for resp in call:
                    now = loop.time() - t0
                    n = len(resp.token_ids)
                    if n and rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.completion_tokens += n
                    rec.chunks += 1
                    counters.tokens += n
                    if resp.finish_reason:
                        rec.prompt_tokens = resp.usage.prompt_tokens
                        rec.server_ttft_ms, rec.server_e2e_ms = resp.ttft_ms, resp.e2e_ms
                rec.end_s = loop.time() - t0
                rec.status = "ok"
            except asyncio.CancelledError:
                rec.status = "cancelled"
                raise
            except grpc.aio.AioRpcError as exc:
                rec.status, rec.error = exc.code().name, (exc.details() or "")[:200]
            finally:
                counters.in_flight -= 1
                counters.finished.append(rec)
                if progress is not None:
                    progress.advance()

    async def sampler() -> None:
        last_t, last_tokens, seen = 0.0, 0, 0
        while not stop_sampling.is_set():
            try:
                await asyncio.wait_for(stop_sampling.wait(), cfg.sample_interval_s)
            except asyncio.TimeoutError:
                pass
            now = loop.time() - t0
            done = counters.finished[seen:]
            seen = len(counters.finished)
            e2e = [r.e2e_s for r in done if r.ok]
            ttft = [r.ttft_s for r in done if r.ok and r.ttft_s is not None]
            dt = max(now - last_t, 1e-9)
            row = {"t": now, "offered_rps": workload.offered_rps(max(0.0, now - 5.0), now) if now > 0 else 0.0,
                   "nominal_rps": workload.nominal_rps(now),
                   "in_flight": counters.in_flight, "sent": counters.sent, "tokens_per_s": (counters.tokens - last_tokens) / dt,
                   "finished": len(done), "e2e_s": sum(e2e) / len(e2e) if e2e else None,
                   "ttft_s": sum(ttft) / len(ttft) if ttft else None}
            last_t, last_tokens = now, counters.tokens
            if probe is not None:
                try:
                    row.update(await probe())
                except Exception as exc:  # a probe failure must not end the run; it is recorded
                    row["probe_error"] = repr(exc)[:200]
            samples.append(row)

    async def client(queue: list[int]) -> None:
        while queue and loop.time() - t0 < workload.duration_s:
            i = queue.pop()
            rec = records[i]
            rec.planned_s = loop.time() - t0
            counters.sent += 1
            await one(rec, prompts[i])

    sampler_task = asyncio.create_task(sampler())
    tasks: list[asyncio.Task] = []
    queue: list[int] = []  # closed loop: requests no client has taken yet
    try:
        if workload.clients:
            queue = list(range(len(records)))[::-1]  # pop() takes them in order
            tasks = [asyncio.create_task(client(queue)) for _ in range(workload.clients)]
            drain_s = workload.duration_s + cfg.drain_timeout_s
        else:
            for rec, prompt in zip(records, prompts):
                if rec.planned_s > cfg.max_duration_s:
                    rec.status = "not_sent"
                    continue
                delay = rec.planned_s - (loop.time() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                counters.sent += 1
                tasks.append(asyncio.create_task(one(rec, prompt)))
            drain_s = cfg.drain_timeout_s
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for i in queue:
            records[i].status = "not_sent"
    finally:
        for task in tasks:
            task.cancel()
        stop_sampling.set()
        await sampler_task
        if progress is not None:
            progress.close()
        if own_channel:
            await channel.close()
    for rec in records:
        if rec.status == "pending":  # cancelled while waiting for the in-flight gate
            rec.status = "cancelled"
    return LoadResult(cfg.label, workload.name, started_unix, loop.time() - t0, records, samples)


class _Progress:
    """A rich progress bar of finished requests."""

    def __init__(self, label: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # stderr: stdout carries the report, and may be redirected to a file.
        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=Console(stderr=True))
        self._task = self._bar.add_task(label or "load", total=total)
        self._bar.start()

    def advance(self) -> None:
        self._bar.advance(self._task)

    def close(self) -> None:
        self._bar.stop()


async def model_info(target: str, timeout_s: float = 10.0) -> pb.GetModelInfoResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)
