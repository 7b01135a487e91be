"""Compare: the same workloads against a freshly started stack per policy, side by side.

Every policy gets a new ``Stack`` with the same seed, workloads, models and memory budget, so the
policy is the only difference between runs. The loads are multiples of a capacity calibrated
first, beside the γ that standard speculative decoding would run (``fixed:G``); the order of it
all: ``run_comparison``."""

from __future__ import annotations

import asyncio
import json
import math
import os
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from nightjar import paths
from nightjar_tools.bench import report
from nightjar_tools.bench.loadgen import LoadConfig, LoadResult, model_info, run_load
from nightjar_tools.bench.probe import StackProbe, bench_source, recording, summarize_steps
from nightjar_tools.bench.workload import LengthScale, PromptBank, Workload, build
from nightjar.keys import Keys
from nightjar.messages import Policy, PolicyHold, StepStats
from nightjar.service_util import connect_redis, write_and_publish
from nightjar_tools.stack import Stack, StackConfig
from planner_svc.config import PlannerConfig
from planner_svc.simulator.oracle import surface_gammas, table_of
from planner_svc.simulator.trace import synthetic_lengths

PLANNER_GAMMA_MAX = PlannerConfig.gamma_max  # the planner's default --gamma-max: a fixed:G above it would be refused
# A γ whose batch-1 speed is within this share of the fastest γ's ties with it: the probe's
# run-to-run spread flipped the best γ between 3 and 4 at this margin ("Headline, sixteenth
# session" in BENCHMARKS.md)
GAMMA_TIE = 0.03
GAMMA_SWITCH_S = 1.5  # the γ probe's wait after publishing a γ: the worker follows the policy channel


def kind_of(spec: str) -> str:
    """How a workload counts for the goals: dynamic, low (steady), overload (steady) or sweep."""
    if spec.startswith("poisson:"):
        rho = float(spec.split(":", 1)[1])
        return "low" if rho <= 0.5 else "overload" if rho >= 1.0 else "steady"
    if spec.startswith("rates:"):
        return "sweep"
    if spec.startswith("closed:"):
        return "closed"
    return "dynamic"


@dataclass(frozen=True)
class WorkloadPlan:
    spec: str
    duration_s: float

    @property
    def kind(self) -> str:
        return kind_of(self.spec)


@dataclass(frozen=True)
class CompareConfig:
    policies: tuple[str, ...]
    workloads: tuple[WorkloadPlan, ...]
    out_dir: Path
    seed: int = 0
    scale: LengthScale = LengthScale()
    drain_timeout_s: float = 30.0
    kv_budget_bytes: int | None = None  # the worker's KV budget (the memory overload scenario's)
    worker_args: tuple[str, ...] = ()
    planner_args: tuple[str, ...] = ()
    prior_surface: Path | None = None  # nightjar's warm start (StackConfig.prior_surface)
    target_model: Path = paths.DEFAULT_TARGET
    draft_model: Path = paths.DEFAULT_DRAFT
    workers: int = 1
    # torch threads per worker. 1, not cores ÷ workers: on a shared 2-core machine OpenMP threads
    # that wait on each other's barrier slow a step by an order of magnitude (BENCHMARKS.md,
    # "Figures that were code comments").
    worker_threads: int = 1
    capacity_rps: float | None = None  # skip the capacity probe
    max_requests: int = 2000  # per open-loop workload; a trace with more arrivals loses its tail (logged)
    fixed_gamma: int | None = None  # skip the batch-1 γ probe
    gamma_probe_tokens: int = 64
    gamma_probe_requests: int = 8  # single requests per γ, on the same prompts for every γ (3 ranked γ by noise)
    capacity_probe_concurrency: int = 32  # requests kept in flight by the capacity probe (throughput still grows past 16 on CPU)
    capacity_probe_s: float = 20.0
    capacity_probe_warmup_s: float = 4.0  # the first prefills and the batch filling up are not steady state
    progress: bool = True
    repeats: int = 1  # the whole policy sweep, repeated (fresh stacks each time)
    # After each repeat's sweep, run the hindsight oracle (report.oracle_table of that repeat's
    # measured surface, per workload) on one more stack, the bench publishing its table.
    oracle: bool = False
    record: bool = False  # write every run's engine steps to OUT/steps/ (the planner tests' replay format)
    # Probe the capacity again before every repeat after the first, and scale that repeat's loads
    # to it (γ stays the first calibration's): the ratios depend on how far a trace overloads each
    # policy, and a machine that runs faster later makes a fixed-rate trace a lighter overload.
    recalibrate: bool = False
    # Continue the run whose results.json is in out_dir (same configuration): its calibration is
    # reused, every stack that finished all its workloads is kept, one cut short runs again.
    resume: bool = False

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if not self.policies:
            raise ValueError("give at least one --policies entry")
        if not self.workloads:
            raise ValueError("give at least one --workloads entry")
        if self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.gamma_probe_requests < 1:
            raise ValueError(f"gamma_probe_requests must be >= 1, got {self.gamma_probe_requests}")
        if self.capacity_rps is not None and not self.capacity_rps > 0:
            raise ValueError(f"--capacity-rps must be > 0, got {self.capacity_rps}")
        odd = [p for p in self.policies if _reads_surface(p) and p != "table:S" and p.split(":")[0] != "threshold"]
        if odd:
            raise ValueError(f"policy {odd[0]!r}: only table:S and threshold:S[:G] take S")
        if self.recalibrate and all(w.spec.startswith("closed:") for w in self.workloads):
            raise ValueError("--recalibrate rescales the loads to a new capacity, and closed-loop workloads have none")
        if self.prior_surface is None and any(_reads_surface(p) for p in self.policies):
            raise ValueError("table:S and threshold:S read the best γ per batch size off the prior surface, and there is "
                             "none for this target and device: pass --prior-surface FILE, or write the table out "
                             "(table:1=4,2=2,...; threshold:B:G)")

    def stack_config(self, policy: str, log_dir: Path, planner: bool = True) -> StackConfig:
        args = list(self.worker_args)
        if self.kv_budget_bytes:
            args += ["--kv-budget-bytes", str(self.kv_budget_bytes)]
        # Same exploration seed for every learning policy, so a rerun repeats its choices.
        planner_args = ("--seed", str(self.seed), *self.planner_args)
        return StackConfig(port=0, workers=self.workers, policy=policy, planner=planner, worker_args=tuple(args),
                           target_path=self.target_model, draft_path=self.draft_model,
                           worker_threads=self.worker_threads,
                           planner_args=planner_args, prior_surface=self.prior_surface if planner else None,
                           log_dir=log_dir, log_level="WARNING")


def policy_order(policies: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The policies in the order repeat ``rep`` runs them. Repeats interleave the policies, so a
    change in the machine's load hits them all alike; odd repeats run them in reverse, so that a
    steady drift in the machine's speed (seen: 1.3× slower steps 15 min later) cancels out of the
    repeat-averaged ratios instead of favouring whoever runs first."""
    return policies if rep % 2 == 0 else policies[::-1]


def speed_probe_ms(rounds: int = 7) -> float:
    """Median ms of a fixed CPU task (a Python loop and small float32 matmuls, like a small
    model's decode step), taken while the stack is idle: a run's figure for how fast the machine
    was, since fresh stacks on a shared machine differ by more than the policies do."""
    a = np.ones((32, 256), np.float32)  # small enough that BLAS stays on one thread
    b = np.ones((256, 256), np.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        x = 0
        for i in range(100_000):
            x += i & 7
        for _ in range(50):
            a @ b
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def draft_weight_bytes(model_dir: Path = paths.DEFAULT_DRAFT, dtype_bytes: int = 4) -> int:
    """Bytes of the draft's weights on the device: parameters (from the safetensors header,
    no torch needed) × the worker's element size (float32 by default)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    if total == 0:
        raise ValueError(f"{model_dir} holds no *.safetensors weights")
    return total * dtype_bytes


def kv_budget_for_share(share: float, model_dir: Path = paths.DEFAULT_DRAFT) -> int:
    """The KV budget (target + draft pools) of which the draft's weights are ``share``: the
    memory work's overload scenario (an 8B target with a 1B draft on a 24 GB card gains ~60%
    more KV when the draft leaves)."""
    if not 0 < share <= 4:
        raise ValueError(f"--draft-share must be in (0, 4], got {share}")
    return int(draft_weight_bytes(model_dir) / share)


def _reads_surface(spec: str) -> bool:
    return spec.partition(":")[2].split(":")[0] == "S"


def resolve_policy(spec: str, fixed_gamma: int, surface: list[int] | None = None) -> str:
    """Policy specs may say ``G`` for the calibrated best γ at batch 1 (``fixed:G``, ``threshold:4:G``)
    and ``S`` for what the prior surface says (``surface``: its best γ at batch 1, 2, ...;
    oracle.surface_gammas): ``table:S`` is that table, vLLM's per-batch-size table tuned offline;
    ``threshold:S:G`` speculates up to the batch size before its first γ = 0."""
    if _reads_surface(spec):
        name, _, arg = spec.partition(":")
        if not surface:
            raise ValueError(f"policy {spec!r}: S reads the prior surface, and there is none")
        if name == "threshold":
            last = surface.index(0) if 0 in surface else len(surface)  # batch sizes 1..last speculate
            spec = f"threshold:{last}{arg[1:]}" if last else "off"
        else:  # table:S (CompareConfig refuses any other)
            spec = "table:" + ",".join(f"{b}={g}" for b, g in table_of(surface).items())
    return spec.replace(":G", f":{fixed_gamma}")


# --------------------------------------------------------------------------- one run


async def run_on_stack(stack: Stack, workload: Workload, prompts: list[str], cfg: CompareConfig, label: str,
                       steps_into: list[StepStats] | None = None) -> tuple[LoadResult, dict]:
    """The workload's result and its steps' summary; ``steps_into`` also receives every step."""
    probe = StackProbe(stack.redis_url, stack.cfg.key_prefix)
    try:
        await probe.start()
        load_cfg = LoadConfig(target=stack.address, max_duration_s=workload.duration_s, drain_timeout_s=cfg.drain_timeout_s,
                              seed=cfg.seed, progress=cfg.progress, label=label)
        result = await run_load(workload, prompts, load_cfg, probe=probe)
        await probe.read_steps()
        if steps_into is not None:
            steps_into.extend(probe.steps)
        return result, summarize_steps(probe.steps, (result.started_unix + workload.warmup_s) * 1000,
                                       (result.started_unix + workload.duration_s) * 1000)
    finally:
        await probe.close()


async def warm_up(stack: Stack, cfg: CompareConfig, bank: PromptBank) -> None:
    """Two short requests, uncounted: the first steps of a fresh stack load and compile."""
    await run_on_stack(stack, _fixed_workload(2, 16, 8), [bank.text(16, np.random.default_rng(1))] * 2, _quiet(cfg), "warmup")


async def wait_idle(stack: Stack, timeout_s: float = 30.0) -> bool:
    """Until every worker reports nothing running or waiting (the previous run's stragglers)."""
    probe = StackProbe(stack.redis_url, stack.cfg.key_prefix)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hbs = await probe.heartbeats()
            if hbs and all(h.running == 0 and h.waiting == 0 for h in hbs):
                return True
            await asyncio.sleep(0.5)
        return False
    finally:
        await probe.close()


def _fixed_workload(n: int, prompt_tokens: int, output_tokens: int, gap_s: float = 0.0) -> Workload:
    return Workload("fixed", np.arange(n) * gap_s, np.full(n, prompt_tokens), np.full(n, output_tokens), max(n * gap_s, 1.0), 1.0)


# --------------------------------------------------------------------------- calibration


async def _publish(stack: Stack, gamma: int, version: int, table: dict[int, int] | None = None, name: str = "") -> None:
    """Publish a policy to a stack without a planner: ``gamma`` everywhere, or ``table``
    ({bucket upper bound: γ}; the last bucket also covers larger batches)."""
    keys = Keys(stack.cfg.key_prefix)
    bounds, gammas = (tuple(table), tuple(table.values())) if table else ((1,), (gamma,))
    pol = Policy(version=version, unix_ms=int(time.time() * 1000), ttl_s=3600.0, bucket_upper_bounds=bounds,
                 gamma_by_bucket=gammas, name=name or f"bench-calibration-{gamma}")
    r = connect_redis(stack.redis_url)
    try:
        await write_and_publish(r, lambda pipe: pipe.set(keys.policy, pol.encode()), keys.policy_channel, pol.encode())
    finally:
        await r.aclose()


class _Refreshed:
    """Something a run needs kept fresh in Redis: ``_refresh`` now, then every ``every_s`` until
    ``_stop``."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._task: asyncio.Task | None = None
        self._stopped = False

    async def _refresh(self) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(self._loop())

    async def _stop(self) -> None:
        # The flag as well as the cancel: a cancel that lands while redis-py is mid-command can be
        # swallowed there, and the loop then slept on with its task "cancelling" for good (a
        # 12-round bench hung in this await for minutes).
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.every_s + 5.0)

    async def _loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.every_s)
            if not self._stopped:
                await self._refresh()


class KeepPublished(_Refreshed):
    """Hold a bench-published policy in force for a whole run: workers ignore a policy older
    than their ``policy_ttl_s`` (10 s by default) and fall back to their default γ, so the bench
    republishes it, as a planner does, every ``every_s`` with a fresh stamp and a higher version."""

    def __init__(self, stack: Stack, gamma: int = 0, table: dict[int, int] | None = None, name: str = "",
                 every_s: float = 2.0, first_version: int = 1) -> None:
        super().__init__(every_s)
        self.stack, self.gamma, self.table, self.name = stack, gamma, table, name
        self.version = first_version

    async def __aenter__(self) -> "KeepPublished":
        await self._start()
        await asyncio.sleep(1.5)  # the worker follows the policy channel
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stop()

    async def _refresh(self) -> None:
        self.version += 1
        await _publish(self.stack, self.gamma, self.version, table=self.table, name=self.name)


class HeldByPlanner(_Refreshed):
    """Have a stack's own planner publish the static policy ``spec`` for a run, through
    keys.planner_hold: one stack runs the learner and the static policies in turn, and the
    planner learns nothing from the held steps (planner_svc.service). The key is set with an
    expiry and refreshed, so a bench that dies lets the planner go back to its own policy."""

    def __init__(self, stack: Stack, spec: str, every_s: float = 2.0, expire_s: float = 10.0,
                 timeout_s: float = 10.0) -> None:
        super().__init__(every_s)
        self.stack, self.spec, self.expire_s, self.timeout_s = stack, spec, expire_s, timeout_s
        self.keys = Keys(stack.cfg.key_prefix)
        self._redis = None

    async def __aenter__(self) -> "HeldByPlanner":
        self._redis = connect_redis(self.stack.redis_url)
        try:
            await self._start()
            await self._until(lambda name: name == f"hold:{self.spec}", "take the hold")
        except BaseException:
            await self._stop()
            await self._redis.delete(self.keys.planner_hold)
            await self._redis.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stop()
        try:
            await self._redis.delete(self.keys.planner_hold)
            await self._until(lambda name: not name.startswith("hold:"), "lift the hold")
        finally:
            await self._redis.aclose()

    async def _refresh(self) -> None:
        await self._redis.set(self.keys.planner_hold, PolicyHold(self.spec, reason="bench").encode(),
                              px=int(self.expire_s * 1000))

    async def _until(self, ok, what: str) -> None:
        """Wait until the published policy's name passes ``ok``, then a moment for the workers."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            raw = await self._redis.get(self.keys.policy)
            if raw and ok(Policy.decode(raw).name):
                await asyncio.sleep(0.3)  # the workers follow the policy channel
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the stack's planner did not {what} ({self.spec}) within {self.timeout_s:g} s: is it running?")


def pick_gamma(speeds: dict[int, float], tie: float = GAMMA_TIE) -> int:
    """{γ: batch-1 tokens/s} -> the smallest γ within ``tie`` of the fastest. Between γs the probe
    cannot tell apart, the smaller one wastes less verify work under load: the stronger peer."""
    top = max(speeds.values())
    return min(g for g, tps in speeds.items() if tps >= (1.0 - tie) * top)


async def probe_gamma(stack: Stack, cfg: CompareConfig, bank: PromptBank, gamma_max: int) -> dict:
    """The γ that decodes one request fastest; needs a stack without a planner (it publishes).

    The γs take turns request by request, the order reversed every round, after one uncounted
    request each: run in blocks, one γ after another, a machine that slowed for a minute ranked
    the γs by when they ran (BENCHMARKS.md, "Headline, twentieth session")."""
    gammas = list(range(min(gamma_max, PLANNER_GAMMA_MAX) + 1))
    prompt_rng = np.random.default_rng(cfg.seed)  # the same prompts for every γ
    prompts = [bank.text(32, prompt_rng) for _ in range(cfg.gamma_probe_requests)]
    wl = _fixed_workload(1, 32, cfg.gamma_probe_tokens)
    decode_s = dict.fromkeys(gammas, 0.0)
    decoded = dict.fromkeys(gammas, 0)
    acceptance: dict[int, list[float]] = {g: [] for g in gammas}
    spec_share = dict.fromkeys(gammas, 0.0)
    version = 1000
    rounds = [(None, gammas)] + [(i, gammas if i % 2 == 0 else gammas[::-1]) for i in range(cfg.gamma_probe_requests)]
    for rep, order in rounds:
        for g in order:
            version += 1
            await _publish(stack, g, version=version)
            await asyncio.sleep(GAMMA_SWITCH_S)
            prompt = prompts[0 if rep is None else rep]
            res, steps = await run_on_stack(stack, wl, [prompt], _quiet(cfg), f"γ={g}#{'warm-up' if rep is None else rep}")
            if rep is None:
                continue  # the first request at each γ is not counted
            rec = res.records[0]
            if rec.ok and rec.itl_s:
                # decode time after the first token (no prefill, no queue), pooled over requests
                decode_s[g] += rec.itl_s * (rec.completion_tokens - 1)
                decoded[g] += rec.completion_tokens - 1
            if steps.get("acceptance") is not None:
                acceptance[g].append(steps["acceptance"])
            spec_share[g] = max(spec_share[g], steps.get("spec_step_share") or 0.0)
    out: dict = {"gamma_probe": {}, "notes": []}
    for g in gammas:
        out["gamma_probe"][g] = {"tokens_per_s": decoded[g] / decode_s[g] if decode_s[g] else 0.0,
                                 "acceptance": float(np.mean(acceptance[g])) if acceptance[g] else None,
                                 "spec_step_share": spec_share[g]}
        if g > 0 and not spec_share[g]:
            out["notes"].append(f"γ={g} was published but no step ran with γ > 0: the worker did not follow the policy")
    out["fixed_gamma"] = pick_gamma({g: x["tokens_per_s"] for g, x in out["gamma_probe"].items()})
    out["gamma_probe_note"] = (f"batch-1 decode tokens/s after the first token, per γ, pooled over {cfg.gamma_probe_requests} "
                               f"single requests on the same prompts, the γs taking turns (one uncounted request each first); "
                               f"the smallest γ within {GAMMA_TIE:.0%} of the fastest")
    await _publish(stack, 0, version=version + 1)  # the capacity probe that may follow runs at γ = 0
    await asyncio.sleep(GAMMA_SWITCH_S)
    return out


async def probe_capacity(stack: Stack, cfg: CompareConfig, bank: PromptBank) -> dict:
    """Saturated request rate with the workloads' length mix, measured closed-loop.

    Many requests arrive at once but the client keeps only ``capacity_probe_concurrency`` in
    flight (a finished one is replaced at once), so the stack stays saturated with a steady
    batch; after ``capacity_probe_s`` the rest is cancelled. The token rate after a warm-up of
    ``capacity_probe_warmup_s`` (prefills included, as in the real workloads) ÷ the mix's mean
    output length is the capacity in requests/s.
    """
    n = 400  # more than the probe can finish: it is cut off by time
    p, o = cfg.scale.apply(*synthetic_lengths(np.random.default_rng(cfg.seed + 1), n))
    wl = Workload("capacity-probe", np.zeros(n), p, o, 1.0, 1.0)
    load_cfg = LoadConfig(target=stack.address, max_duration_s=1.0, drain_timeout_s=cfg.capacity_probe_s,
                          max_in_flight=cfg.capacity_probe_concurrency, seed=cfg.seed, progress=False, label="capacity")
    probe = StackProbe(stack.redis_url, stack.cfg.key_prefix)
    try:
        await probe.start()
        res = await run_load(wl, bank.texts(wl, cfg.seed), load_cfg, probe=probe)
        await probe.read_steps()
        steps = summarize_steps(probe.steps)
    finally:
        await probe.close()
    mix_p, mix_o = cfg.scale.apply(*synthetic_lengths(np.random.default_rng(0), 20000))
    warm = [x["tokens_per_s"] for x in res.samples if x["t"] >= cfg.capacity_probe_warmup_s]
    tps = float(np.mean(warm)) if warm else 0.0
    if tps <= 0:
        raise RuntimeError(f"the capacity probe saw no tokens in {cfg.capacity_probe_s:.0f} s; see the logs in {stack.log_dir}")
    return {"capacity_rps": tps / float(mix_o.mean()),
            "capacity_probe": {"saturated_tokens_per_s": tps, "concurrency": cfg.capacity_probe_concurrency,
                               "finished": sum(r.ok for r in res.records), "mean_output_tokens": float(mix_o.mean()),
                               "mean_prompt_tokens": float(mix_p.mean()), "mean_batch": steps.get("mean_batch"),
                               "gamma_share": steps.get("spec_step_share"), "seconds": cfg.capacity_probe_s}}


def _quiet(cfg: CompareConfig) -> CompareConfig:
    return replace(cfg, progress=False)


# --------------------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    cfg: CompareConfig
    calibration: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    samples: dict[str, list[dict]] = field(default_factory=dict)  # "policy|workload" -> timeline
    stack_start_s: dict[str, float] = field(default_factory=dict)
    started_unix: float = 0.0

    def config(self) -> dict:
        """The settings results.json records (and ``--resume`` compares). The CPU is one of them: a
        stack's speed and crossover move with it, so a run resumed on another kind of machine would
        pair repeats measured on two."""
        c = self.cfg
        return {"cpu": paths.cpu_signature(), "l3_kib": paths.cpu_l3_kib(),
                "policies": c.policies, "workloads": [(w.spec, w.duration_s) for w in c.workloads],
                "seed": c.seed, "scale": c.scale.__dict__, "max_requests": c.max_requests,
                "kv_budget_bytes": c.kv_budget_bytes, "target_model": str(c.target_model),
                "draft_model": str(c.draft_model), "draft_weight_bytes": draft_weight_bytes(c.draft_model),
                "drain_timeout_s": c.drain_timeout_s, "workers": c.workers, "worker_threads": c.worker_threads,
                "worker_args": c.worker_args, "planner_args": c.planner_args,
                "prior_surface": str(c.prior_surface) if c.prior_surface else None}

    def payload(self) -> dict:
        kinds = {w.spec: w.kind for w in self.cfg.workloads}
        payload = {"config": self.config(),
                "started_unix": self.started_unix, "calibration": self.calibration, "stack_start_s": self.stack_start_s,
                "runs": self.runs, "samples": self.samples}
        payload["goals"] = report.goal_rows(self.runs, kinds) + report.learning_rows(payload)
        return payload


def run_comparison(cfg: CompareConfig, log=print) -> Comparison:
    """Calibration first: unless γ is given, a stack without a planner runs γ = 0…4 one request at
    a time, the bench publishing each fixed policy itself (the γ that decodes fastest at batch 1 is
    what standard speculative decoding would run: ``fixed:G``), then a closed-loop probe at γ = 0
    measures the saturated capacity that the workloads' loads are multiples of (with γ given, only
    the probe runs there). Then every policy's stack (embedded Redis, gateway, scheduler, planner
    ``--policy``, workers) is warmed up with two short requests and runs the workloads in the same
    order, draining between them. With ``repeats`` the whole sweep runs again, policies interleaved
    (and with ``recalibrate`` after its own capacity probe)."""
    return asyncio.run(_run_comparison(cfg, log))


class RunningStack:
    """A Stack started and stopped off the event loop (both block for seconds)."""

    def __init__(self, cfg: StackConfig) -> None:
        self.stack = Stack(cfg)

    async def __aenter__(self) -> Stack:
        starting = asyncio.ensure_future(asyncio.to_thread(self.stack.start))
        try:
            return await asyncio.shield(starting)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM) mid-start: __aexit__ will not run and the thread cannot
            # be cancelled, so it is told to give up (and stops what it started), and a stack that
            # came up anyway is stopped here.
            self.stack.abort_start()
            await asyncio.wait([starting])
            if not starting.cancelled() and starting.exception() is None:
                await asyncio.to_thread(self.stack.stop)
            raise

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stack.stop)


async def _run_comparison(cfg: CompareConfig, log) -> Comparison:
    cmp = Comparison(cfg, started_unix=time.time())
    finished = resume(cmp, log) if cfg.resume else set()
    bank = PromptBank()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    cal: dict = cmp.calibration or {"notes": [], "fixed_gamma": cfg.fixed_gamma, "capacity_rps": cfg.capacity_rps}
    # Closed loops need no capacity, and explicit γs no batch-1 γ probe: skip what nothing uses.
    if all(w.spec.startswith("closed:") for w in cfg.workloads) and cal["capacity_rps"] is None:
        cal["capacity_rps"] = 1.0
        cal["notes"].append("closed-loop workloads only: no capacity probe")
    if cal["fixed_gamma"] is None and not any(":G" in p for p in cfg.policies):
        cal["fixed_gamma"] = 0
        cal["notes"].append("no policy names G: no batch-1 γ probe")
    if cal["fixed_gamma"] is None or cal["capacity_rps"] is None:
        await _calibrate(cfg, bank, cal, "calibration", log)
    cmp.calibration = cal
    report.write_json(cfg.out_dir / "results.json", cmp.payload())  # a run stopped now keeps its calibration
    log(f"capacity {cal['capacity_rps']:.3f} req/s; best γ at batch 1: {cal['fixed_gamma']}")
    gamma = cal["fixed_gamma"]
    surface = None
    if any(_reads_surface(p) for p in cfg.policies):
        surface = surface_gammas(cfg.prior_surface, PLANNER_GAMMA_MAX)
        cal["surface_table"] = {str(b): g for b, g in table_of(surface).items()}
        log(f"table:S, threshold:S from {cfg.prior_surface.name}: best γ {cal['surface_table']} (batch size upper bound: γ)")
    total, ran, t_start = cfg.repeats * len(cfg.policies), 0, time.monotonic()
    cap = cal["capacity_rps"]
    if cfg.recalibrate:
        cal.setdefault("recalibrated", {"0": cap})  # {repeat: the capacity its loads were scaled to}
    for rep in range(cfg.repeats):
        if rep and cfg.recalibrate:
            if str(rep) in cal["recalibrated"]:  # probed before the run that is resumed stopped
                cap = cal["recalibrated"][str(rep)]
            else:
                again = {"fixed_gamma": gamma, "capacity_rps": None, "notes": []}
                await _calibrate(cfg, bank, again, f"calibration-r{rep}", log)
                cap = cal["recalibrated"][str(rep)] = again["capacity_rps"]
                cal.setdefault("recalibration_probes", {})[str(rep)] = again["capacity_probe"]
            log(f"repeat {rep + 1}: capacity {cap:.3f} req/s")
        if rep == 0 or cfg.recalibrate:
            workloads = [build(w.spec, cap, w.duration_s, seed=cfg.seed, scale=cfg.scale, max_requests=cfg.max_requests)
                         for w in cfg.workloads]
            prompts = [bank.texts(wl, cfg.seed) for wl in workloads]
        for i, spec in enumerate(policy_order(cfg.policies, rep)):
            policy = resolve_policy(spec, gamma, surface)
            done = rep * len(cfg.policies) + i + 1
            if (policy, rep) in finished:
                log(f"policy {policy} (repeat {rep + 1}/{cfg.repeats}): kept from the resumed run")
                continue
            await _one_policy(cmp, cfg, policy, rep, bank, workloads, prompts, log)
            ran += 1
            eta_s = (time.monotonic() - t_start) / ran * (total - done) * (1 + cfg.oracle / len(cfg.policies))
            log(f"progress {done}/{total} stacks" + (f", ETA {eta_s / 60:.0f} min" if done < total or cfg.oracle else ""))
        if cfg.oracle and (report.ORACLE, rep) not in finished:
            await _oracle(cmp, cfg, rep, bank, workloads, prompts, log)
    return cmp


class ResumeError(ValueError):
    """--resume cannot continue the folder's run (none there, or other settings)."""


def resume(cmp: Comparison, log) -> set[tuple[str, int]]:
    """Load the run to continue from ``cmp.cfg.out_dir``/results.json into ``cmp``; -> the (policy,
    repeat) stacks it finished, the hindsight oracle's as (report.ORACLE, repeat). A stack that did
    not finish every workload is dropped and runs again: its planner learned from the workloads
    before, so the rest cannot run on a fresh stack."""
    cfg, path = cmp.cfg, cmp.cfg.out_dir / "results.json"
    try:
        prior = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResumeError(f"--resume: {path} does not exist; nothing to resume (run without --resume)") from None
    except (OSError, ValueError) as exc:
        raise ResumeError(f"--resume: {path} is unreadable: {exc}") from None
    want, had = json.loads(json.dumps(cmp.config())), prior.get("config", {})
    differ = sorted(k for k in set(want) | set(had) if want.get(k) != had.get(k))
    cal = prior.get("calibration") or {}
    for key, given in (("capacity_rps", cfg.capacity_rps), ("fixed_gamma", cfg.fixed_gamma)):
        if given is not None and cal.get(key) is not None and cal[key] != given:
            differ.append(key)
    if differ:
        raise ResumeError(f"--resume: {path} was run with other settings ({', '.join(differ)}); resume with the same "
                         "arguments (a larger --repeats adds repeats), or pick a new --out")
    specs = [w.spec for w in cfg.workloads]
    ran: dict[tuple[str, int], set[str]] = {}
    for run in prior.get("runs", []):
        ran.setdefault((run["policy"], run.get("repeat", 0)), set()).add(run["workload"])
    tables = cal.get("oracle_tables", {})

    def complete(policy: str, rep: int) -> bool:
        if policy != report.ORACLE:
            return ran[policy, rep] >= set(specs)
        # the oracle skips a workload where no cell had enough steps to choose by (an empty table)
        return str(rep) in tables and ran[policy, rep] >= {w for w, t in tables[str(rep)].items() if t}

    finished = {unit for unit in ran if complete(*unit)}
    dropped = sorted(set(ran) - finished)
    cmp.calibration = cal
    cmp.runs = [r for r in prior.get("runs", []) if (r["policy"], r.get("repeat", 0)) in finished]
    cmp.samples = {k: v for k, v in prior.get("samples", {}).items()
                   if report.parse_sample_key(k)[::2] in finished}  # (policy, repeat)
    cmp.stack_start_s = prior.get("stack_start_s", {})
    cmp.started_unix = prior.get("started_unix", cmp.started_unix)
    log(f"resuming {path}: {len(finished)} finished stacks kept"
        + (f"; cut short, run again: {', '.join(f'{p} (repeat {r + 1})' for p, r in dropped)}" if dropped else ""))
    return finished


async def _calibrate(cfg: CompareConfig, bank: PromptBank, cal: dict, name: str, log) -> None:
    """Fill ``cal``'s missing γ and capacity on a stack without a planner (the bench publishes):
    the γ probe first, then the capacity at γ = 0."""
    async with RunningStack(cfg.stack_config("off", cfg.out_dir / "logs" / name, planner=False)) as stack:
        info = await model_info(stack.address)
        log(f"calibrating on {stack.address} (model {info.model}, draft {info.draft_model or 'none'}, γmax {info.gamma_max})")
        if cal["fixed_gamma"] is None:
            g = await probe_gamma(stack, cfg, bank, info.gamma_max)
            cal["notes"] += g.pop("notes")
            cal.update(g)
        if cal["capacity_rps"] is None:
            cal.update(await probe_capacity(stack, cfg, bank))


async def _oracle(cmp: Comparison, cfg: CompareConfig, rep: int, bank: PromptBank, workloads: list[Workload],
                  prompts: list[list[str]], log) -> None:
    """The hindsight oracle of repeat ``rep``: per workload, the best static table on the surface
    that repeat's runs measured, published by the bench on a stack without a planner."""
    tables = {plan.spec: report.oracle_table([r for r in cmp.runs if r["workload"] == plan.spec and r.get("repeat", 0) == rep])
              for plan in cfg.workloads}
    cmp.calibration.setdefault("oracle_tables", {})[str(rep)] = {k: {str(b): g for b, g in t.items()} for k, t in tables.items()}
    async with RunningStack(cfg.stack_config("off", cfg.out_dir / "logs" / f"oracle-r{rep}", planner=False)) as stack:
        await warm_up(stack, cfg, bank)
        for k, (plan, wl, texts) in enumerate(zip(cfg.workloads, workloads, prompts)):
            table = tables[plan.spec]
            if not table:
                log(f"oracle: no cell of {plan.spec} had {report.ORACLE_MIN_STEPS} decode steps; skipped")
                continue
            if not await wait_idle(stack):
                log(f"oracle: the stack was still busy after 30 s; starting {plan.spec} anyway")
            log(f"oracle (repeat {rep + 1}/{cfg.repeats}): workload {plan.spec}, table {table}")
            speed = speed_probe_ms()
            async with KeepPublished(stack, table=table, name=report.ORACLE, first_version=100_000 * (rep * 100 + k + 1)):
                result, steps = await run_on_stack(stack, wl, texts, cfg, f"oracle | {plan.spec}")
            run = report.summarize_workload(result, steps, wl)
            run.update(policy=report.ORACLE, kind=plan.kind, repeat=rep, loadavg_1m=os.getloadavg()[0], speed_probe_ms=speed,
                       capacity_rps=wl.capacity_rps, oracle_table=table)
            cmp.runs.append(run)
            cmp.samples[report.sample_key(report.ORACLE, plan.spec, rep)] = result.samples
            report.write_json(cfg.out_dir / "results.json", cmp.payload())


async def _one_policy(cmp: Comparison, cfg: CompareConfig, policy: str, rep: int, bank: PromptBank,
                      workloads: list[Workload], prompts: list[list[str]], log) -> None:
    t0 = time.monotonic()
    safe = policy.replace(":", "_").replace(",", "_").replace("=", "-") + (f"-r{rep}" if rep else "")
    async with RunningStack(cfg.stack_config(policy, cfg.out_dir / "logs" / safe)) as stack:
        cmp.stack_start_s[f"{policy}#{rep}"] = time.monotonic() - t0
        await warm_up(stack, cfg, bank)
        for plan, wl, texts in zip(cfg.workloads, workloads, prompts):
            if not await wait_idle(stack):
                log(f"policy {policy}: the stack was still busy after 30 s; starting {plan.spec} anyway")
            shape = (f"{wl.clients} clients, {plan.duration_s:.0f} s after {wl.warmup_s:.0f} s of warm-up" if wl.clients
                     else f"{len(wl)} requests over {plan.duration_s:.0f} s")
            if wl.cut:
                shape += (f"; --max-requests cut the last {wl.cut} arrivals, so they end at {wl.arrival_s[-1]:.0f} s "
                          "and the trace loses its tail")
            log(f"policy {policy} (repeat {rep + 1}/{cfg.repeats}): workload {plan.spec} ({shape})")
            speed = speed_probe_ms()
            seen: list[StepStats] | None = [] if cfg.record else None
            result, steps = await run_on_stack(stack, wl, texts, cfg, f"{policy} | {plan.spec}", steps_into=seen)
            if seen is not None:
                (cfg.out_dir / "steps").mkdir(parents=True, exist_ok=True)
                (cfg.out_dir / "steps" / f"{safe}_{plan.spec.replace('@', '-').replace(':', '_')}.json").write_text(
                    json.dumps(recording(seen, bench_source(policy, plan.spec, rep + 1))))
            run = report.summarize_workload(result, steps, wl)
            # The machine is shared: its load average says how noisy this run's figures are.
            run.update(policy=policy, kind=plan.kind, repeat=rep, loadavg_1m=os.getloadavg()[0], speed_probe_ms=speed,
                       capacity_rps=wl.capacity_rps)
            cmp.runs.append(run)
            cmp.samples[report.sample_key(policy, plan.spec, rep)] = result.samples
            report.write_json(cfg.out_dir / "results.json", cmp.payload())


def load_calibration(path: Path) -> dict:
    data = json.loads(path.read_text())
    return data.get("calibration", data)
