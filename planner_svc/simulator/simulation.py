"""The event loop: a trace, a cost surface, an acceptance process, N workers, one policy.

Workers advance in clock order (the one furthest behind steps next); a request joins the shared
FIFO queue when the stepping worker's clock passes its arrival, and the first worker with a
free slot and KV room admits it (the scheduler's "most free capacity" in pull form). An idle
worker jumps to the next arrival.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from planner_svc.policies.base import GammaPolicy
from planner_svc.simulator.acceptance_process import DEFAULT_ALPHAS, AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface
from planner_svc.simulator.policy_calls import PolicyCalls
from planner_svc.simulator.sim_worker import SimWorker, UniformBuffer
from planner_svc.simulator.trace import Trace


@dataclass(frozen=True)
class SimConfig:
    gamma_max: int = 4
    max_batch: int = 64
    workers: int = 1
    kv_tokens: int = 16384  # target KV pool per worker with the draft resident
    draft_kv_share: float = 0.6  # offloading the draft grows the pool by this share (8B/1B on 24 GB)
    block_tokens: int = 16
    offload_ms: float = 80.0
    reload_ms: float = 80.0
    noise: float = 0.0  # step times × U(1 − noise, 1 + noise)
    # A shared machine's drift: every step time × one U(1 − drift, 1 + drift) per period, the
    # same for every arm at a time, so arms played minutes apart are measured at different speeds.
    drift: float = 0.0
    drift_period_ms: float = 5000.0
    alphas: tuple[float, ...] = DEFAULT_ALPHAS  # used unless the cost surface measured acceptance
    seed: int = 0
    # A closed loop of this many clients (0: open, the trace's arrival times): request i + C is
    # sent when request i finishes, after readmit_ms × U(0.5, 1.5), the client's round trip through
    # the gateway and the queue. Without that gap a finished slot refills in the next step, and
    # the live stack's turnover dips (a cohort ending together, the batch at 3-8 for a step or
    # two while the next requests arrive) never happen. The trace's later arrival times are unused.
    closed_clients: int = 0
    readmit_ms: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_max <= 16 or self.max_batch < 1 or self.workers < 1:
            raise ValueError("need 0 <= gamma_max <= 16, max_batch >= 1, workers >= 1")
        if self.kv_tokens < 1024 or self.draft_kv_share < 0 or not 0 <= self.noise < 1:
            raise ValueError("need kv_tokens >= 1024 (one full context), draft_kv_share >= 0, 0 <= noise < 1")
        if self.offload_ms < 0 or self.reload_ms < 0 or self.block_tokens < 1:
            raise ValueError("offload_ms, reload_ms must be >= 0 and block_tokens >= 1")
        if not 0 <= self.drift < 1 or self.drift_period_ms <= 0:
            raise ValueError("need 0 <= drift < 1 and drift_period_ms > 0")
        if self.closed_clients < 0 or self.readmit_ms < 0:
            raise ValueError("need closed_clients >= 0 and readmit_ms >= 0")


@dataclass
class SimResult:
    trace: str
    policy: str
    requests: int
    output_tokens: int
    makespan_ms: float
    steps: int
    switches: int
    offloads: int
    reloads: int
    latency_ms: np.ndarray = field(repr=False)
    ttft_ms: np.ndarray = field(repr=False)

    @property
    def throughput_tps(self) -> float:
        return self.output_tokens / (self.makespan_ms / 1000.0)

    @property
    def mean_latency_ms(self) -> float:
        return float(self.latency_ms.mean())

    @property
    def p99_latency_ms(self) -> float:
        return float(np.percentile(self.latency_ms, 99))

    @property
    def mean_ttft_ms(self) -> float:
        return float(self.ttft_ms.mean())

    @property
    def switches_per_1000_steps(self) -> float:
        return 1000.0 * self.switches / max(self.steps, 1)


def capacity_rps(surface: CostSurface, config: SimConfig, mean_prompt: float, mean_output: float) -> float:
    """Requests/s one worker sustains at γ = 0 with the draft resident (the load unit of traces)."""
    batch = int(min(config.max_batch, config.kv_tokens // (mean_prompt + mean_output + config.gamma_max),
                    surface.max_batch))
    batch = max(batch, 1)
    step = surface.step_ms(batch, 0)
    per_request_ms = mean_output * step / batch + mean_prompt * surface.prefill_ms_per_token
    return config.workers * 1000.0 / per_request_ms


def simulate(trace: Trace, policy: GammaPolicy, surface: CostSurface, config: SimConfig = SimConfig()) -> SimResult:
    if surface.gamma_max < config.gamma_max or surface.max_batch < config.max_batch:
        raise ValueError(f"cost surface covers γ<={surface.gamma_max}, B<={surface.max_batch}; "
                         f"config needs γ<={config.gamma_max}, B<={config.max_batch}")
    rng = np.random.default_rng(config.seed)
    acceptance = AcceptanceProcess(surface.acceptance or config.alphas, config.gamma_max)
    workers = [SimWorker(f"w{i}", surface=surface, acceptance=acceptance, max_batch=config.max_batch,
                         kv_tokens=config.kv_tokens, draft_kv_share=config.draft_kv_share,
                         block_tokens=config.block_tokens, offload_ms=config.offload_ms,
                         reload_ms=config.reload_ms, gamma_max=config.gamma_max) for i in range(config.workers)]
    arrival_ms = np.array(trace.arrival_ms, dtype=float)  # a closed loop rewrites the later ones
    arrivals = arrival_ms.tolist()  # list: fast scalar reads
    # A request longer than one worker's pool could never be admitted: clip it to fit.
    output_arr = np.minimum(trace.output_tokens, config.kv_tokens - trace.prompt_tokens - config.gamma_max).clip(1)
    prompt, output = trace.prompt_tokens.tolist(), output_arr.tolist()  # lists: fast scalar reads
    uniforms = UniformBuffer(rng)
    total = len(arrivals)
    first = np.full(total, np.nan)
    done = np.full(total, np.nan)
    queue: deque[int] = deque()
    clients = min(config.closed_clients, total)
    pending = [(arrivals[i], i) for i in range(clients)]  # closed loop: (send time, request), a heap
    readmit_rng = np.random.default_rng([config.seed, 2])
    nxt = 0  # open loop: the next arrival in trace order
    calls = PolicyCalls(policy)
    noise, single = config.noise, len(workers) == 1
    by_clock = operator.attrgetter("clock")
    for w in workers:
        w.clock = arrivals[0]
    drift_rng = np.random.default_rng([config.seed, 1])  # its own stream: drift = 0 changes nothing else
    period, speed_until = config.drift_period_ms, -math.inf
    while True:
        w = workers[0] if single else min(workers, key=by_clock)
        now = w.clock
        if now == math.inf:
            break
        if config.drift and now >= speed_until:
            speed = 1.0 + config.drift * (2.0 * drift_rng.random() - 1.0)
            speed_until = (now // period + 1.0) * period
            for other in workers:
                other.speed = speed
        if clients:
            while pending and pending[0][0] <= now:
                queue.append(heapq.heappop(pending)[1])
        else:
            while nxt < total and arrivals[nxt] <= now:
                queue.append(nxt)
                nxt += 1
        stepped = w.step(queue, prompt, output, calls, uniforms, noise, first, done)
        if w.finished:
            if clients:
                for r in w.finished:  # its client sends the next request after the round trip
                    if r + clients < total:
                        sent = float(done[r]) + config.readmit_ms * (0.5 + readmit_rng.random())
                        arrival_ms[r + clients] = sent
                        heapq.heappush(pending, (sent, r + clients))
            w.finished.clear()
        if not stepped:
            if clients:
                upcoming = pending[0][0] if pending else math.inf
            else:
                upcoming = arrivals[nxt] if nxt < total else math.inf
            if upcoming < math.inf:
                w.clock = max(now, upcoming)
            elif queue:
                w.clock += 1.0  # cannot happen with a sane pool; never spin on the same instant
            elif clients and any(other.n for other in workers):
                # a live request on another worker will send the next one: wait for it
                w.clock = max(min(other.clock for other in workers if other.n), now + 0.5)
            else:
                w.clock = math.inf  # nothing left for this worker
    assert not np.isnan(done).any()  # every request finished
    return SimResult(
        trace=trace.name, policy=policy.name, requests=total, output_tokens=int(output_arr.sum()),
        makespan_ms=float(done.max() - arrivals[0]), steps=sum(w.step_no for w in workers),
        switches=sum(w.switches for w in workers), offloads=sum(w.offloads for w in workers),
        reloads=sum(w.reloads for w in workers), latency_ms=done - arrival_ms, ttft_ms=first - arrival_ms)


def trace_for(shape: str, surface: CostSurface, config: SimConfig = SimConfig(), *, requests: int = 2000,
              seed: int = 0, azure_load: float = 0.8) -> Trace:
    """A trace whose load is expressed relative to this surface's and config's capacity."""
    from planner_svc.simulator.trace import make_trace

    return make_trace(shape, lambda p, o: capacity_rps(surface, config, p, o), requests=requests, seed=seed,
                      azure_load=azure_load)
