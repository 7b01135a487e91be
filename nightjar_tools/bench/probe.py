"""StackProbe: what the stack itself says while the load runs, read from Redis.

Workers' heartbeats give the instantaneous state (running, waiting, γ in force, draft
residency, KV blocks); the step statistics stream (``keys.stats``, ``messages.StepStats``) gives
every engine step. The stream is capped, so the probe reads it incrementally on every sample
rather than once at the end, and keeps only the steps of its own run (it starts after the
stream's last id at ``start``). ``redis_url`` is any URL the services take, ``redis+cluster://``
included (``connect_redis``).
"""

from __future__ import annotations

import math
import re
from collections import Counter

from nightjar.keys import Keys
from nightjar.messages import Heartbeat, MessageError, StepStats
from nightjar.service_util import connect_redis
from planner_svc.policies.base import DEFAULT_BUCKETS, bucket_index


class StackProbe:
    def __init__(self, redis_url: str, key_prefix: str = "nj") -> None:
        self.keys = Keys(key_prefix)
        self._redis = connect_redis(redis_url, timeout_s=2.0, block_margin_s=5.0)
        self._last_id = b"0-0"
        self.steps: list[StepStats] = []
        self.undecodable = 0

    async def start(self) -> None:
        """Skip the steps of earlier runs (warm-up, previous workloads)."""
        last = await self._redis.xrevrange(self.keys.stats, count=1)
        self._last_id = last[0][0] if last else b"0-0"
        self.steps = []

    async def close(self) -> None:
        await self._redis.aclose()

    async def heartbeats(self) -> list[Heartbeat]:
        ids = sorted(await self._redis.smembers(self.keys.workers))
        if not ids:
            return []
        raw = await self._redis.mget([self.keys.heartbeat(w.decode()) for w in ids])
        out = []
        for blob in raw:
            if blob is not None:
                try:
                    out.append(Heartbeat.decode(blob))
                except MessageError:
                    self.undecodable += 1
        return out

    async def read_steps(self) -> list[StepStats]:
        """Every step written since the previous call."""
        new: list[StepStats] = []
        while True:
            entries = await self._redis.xrange(self.keys.stats, min=b"(" + self._last_id, count=2000)
            for entry_id, fields in entries:
                self._last_id = entry_id
                for blob in fields.values():
                    try:
                        new.append(StepStats.decode(blob))
                    except MessageError:
                        self.undecodable += 1
            if len(entries) < 2000:
                break
        self.steps.extend(new)
        return new

    async def __call__(self) -> dict:
        """One timeline sample: heartbeat state plus the steps since the last sample."""
        hbs = await self.heartbeats()
        new = await self.read_steps()
        row: dict = {
            "workers": len(hbs),
            "running": sum(h.running for h in hbs),
            "waiting": sum(h.waiting for h in hbs),
            "kv_blocks_total": sum(h.kv_blocks_total for h in hbs),
            "kv_blocks_free": sum(h.kv_blocks_free for h in hbs),
            "gamma_hb": max((h.gamma for h in hbs), default=0),
            "residency": _majority([h.draft_residency for h in hbs]),
            "policy_version": max((h.policy_version for h in hbs), default=-1),
        }
        if new:
            decode_steps = [s for s in new if s.batch_size > 0]
            row["steps"] = len(new)
            row["batch"] = sum(s.batch_size for s in decode_steps) / max(len(decode_steps), 1)
            # γ in force, weighted by steps (γ may change within the sample's half second).
            row["gamma"] = sum(s.gamma for s in decode_steps) / max(len(decode_steps), 1)
            row["step_tokens_per_s"] = sum(s.emitted_tokens for s in new) / max(sum(s.step_ms for s in new) / 1000.0, 1e-9)
            row["residency_step"] = new[-1].draft_residency
        return row


def _majority(values: list[str]) -> str:
    return Counter(values).most_common(1)[0][0] if values else "none"


RECORDING_FIELDS = ("batch_size", "gamma", "draft_ms", "verify_ms", "accepted_per_position", "emitted_tokens",
                    "prefill_tokens", "catchup_tokens", "catchup_ms", "kv_blocks_used", "kv_blocks_free", "waiting",
                    "step_ms", "preempted", "preempted_tokens")


def recording(steps: list[StepStats], source: str) -> dict:
    """Steps in the planner tests' replay format ({"source", "fields", "rows"}; ``replay`` in
    tests/planner_svc/test_planner_regimes.py feeds one to a policy), plus each step's stamp,
    worker and draft residency."""
    rows = [[list(s.accepted_per_position) if f == "accepted_per_position" else getattr(s, f) for f in RECORDING_FIELDS]
            for s in steps]
    return {"source": source, "fields": list(RECORDING_FIELDS), "rows": rows,
            "unix_ms": [s.unix_ms for s in steps], "worker_id": [s.worker_id for s in steps],
            "draft_residency": [s.draft_residency for s in steps]}


def bench_source(policy: str, workload: str, repeat: int) -> str:
    """A ``nightjar bench`` recording's source: what ran, and in which repeat (1-based)."""
    return f"nightjar bench {policy} | {workload}, repeat {repeat}"


def parse_bench_source(source: str) -> tuple[str, str, int] | None:
    """(policy, workload, repeat) of a ``bench_source``; None for any other source."""
    m = _BENCH_SOURCE.match(source)
    return (m["policy"], m["workload"], int(m["repeat"])) if m else None


_BENCH_SOURCE = re.compile(r"nightjar bench (?P<policy>\S+) \| (?P<workload>\S+), repeat (?P<repeat>\d+)$")


def steps_of(rec: dict) -> list[StepStats]:
    """The steps a ``recording`` holds (its inverse, less each step's number and memory figures)."""
    out = []
    for i, (values, unix_ms, worker, residency) in enumerate(zip(rec["rows"], rec["unix_ms"], rec["worker_id"],
                                                                 rec["draft_residency"])):
        row = dict(zip(rec["fields"], values))
        row["accepted_per_position"] = tuple(row["accepted_per_position"])
        out.append(StepStats(worker_id=worker, step=i, unix_ms=unix_ms, draft_residency=residency, **row))
    return out


def summarize_steps(steps: list[StepStats], since_unix_ms: float = 0.0, load_until_unix_ms: float = math.inf) -> dict:
    """Per-run totals from the engine's step statistics (pure; ``steps`` in stream order), over
    the steps from ``since_unix_ms`` on (a closed loop's warm-up is left out). ``load_steps`` and
    ``load_switches`` count only the steps before ``load_until_unix_ms`` (the end of the arrival
    window): in the drain that follows, the batch falls through every bucket and the table's
    γ per batch size shows as switches that steady load never makes."""
    steps = [s for s in steps if s.unix_ms >= since_unix_ms]
    out = {"steps": len(steps), "gamma_switches": 0, "load_steps": 0, "load_switches": 0, "offloads": 0, "reloads": 0,
           "acceptance": None, "accepted_per_step": None, "spec_step_share": 0.0, "catchup_tokens": 0, "catchup_ms": 0.0,
           "preempted": 0, "preempted_tokens": 0, "prefill_tokens": 0, "emitted_tokens": 0, "mean_batch": 0.0,
           "mean_step_ms": 0.0, "prefill_share": 0.0, "acceptance_alarms": 0, "cells": {}}
    if not steps:
        return out
    last_gamma: dict[str, int] = {}
    last_res: dict[str, str] = {}
    proposed = accepted = spec_steps = 0
    for s in steps:
        loaded = s.unix_ms < load_until_unix_ms
        out["load_steps"] += loaded
        # γ is only "in force" on steps that decode; prefill-only steps report 0 whatever the policy.
        if s.batch_size > 0:
            if s.worker_id in last_gamma and s.gamma != last_gamma[s.worker_id]:
                out["gamma_switches"] += 1
                out["load_switches"] += loaded
            last_gamma[s.worker_id] = s.gamma
        prev = last_res.get(s.worker_id)
        if prev is not None and prev != s.draft_residency:
            if s.draft_residency in ("offloading", "offloaded") and prev in ("resident", "reloading"):
                out["offloads"] += 1
            elif s.draft_residency in ("reloading", "resident") and prev in ("offloading", "offloaded"):
                out["reloads"] += 1
        last_res[s.worker_id] = s.draft_residency
        if s.gamma > 0 and s.batch_size > 0:
            spec_steps += 1
            proposed += s.gamma * s.batch_size
            accepted += sum(s.accepted_per_position)
        if s.batch_size > 0 and s.prefill_tokens == 0 and s.catchup_tokens == 0:
            # The run's measured surface: pure decode steps per (batch bucket, γ), for the hindsight oracle.
            cell = out["cells"].setdefault(f"{DEFAULT_BUCKETS[bucket_index(DEFAULT_BUCKETS, s.batch_size)]}|{s.gamma}", [0, 0.0, 0])
            cell[0] += 1
            cell[1] += s.step_ms
            cell[2] += s.emitted_tokens
        out["catchup_tokens"] += s.catchup_tokens
        out["catchup_ms"] += s.catchup_ms
        out["preempted"] += s.preempted
        out["preempted_tokens"] += s.preempted_tokens
        out["prefill_tokens"] += s.prefill_tokens
        out["emitted_tokens"] += s.emitted_tokens
        out["acceptance_alarms"] += int(s.acceptance_alarm)
    out["prefill_share"] = _prefill_share(steps, out["cells"])
    decode = [s for s in steps if s.batch_size > 0]
    out["mean_batch"] = sum(s.batch_size for s in decode) / max(len(decode), 1)
    out["mean_step_ms"] = sum(s.step_ms for s in steps) / len(steps)
    out["spec_step_share"] = spec_steps / max(len(decode), 1)
    if proposed:
        out["acceptance"] = accepted / proposed  # share of drafted tokens the target kept
        out["accepted_per_step"] = accepted / max(sum(s.batch_size for s in decode if s.gamma > 0), 1)
    return out


def _prefill_share(steps: list[StepStats], cells: dict[str, list]) -> float:
    """The share of the engine's step time spent prefilling (prompts, and preempted sequences
    again): a step that carries prefill tokens costs its time less what a pure decode step of its
    (batch bucket, γ) cell costs in the same run, or of the nearest bucket at that γ; one of a γ
    with no pure decode step counts whole, so the share is an upper estimate there. Under
    overload it bounds what any γ policy can gain: γ only changes the rest."""
    by_gamma: dict[int, list[tuple[int, float]]] = {}
    for key, (n, ms, _tokens) in cells.items():
        bucket, gamma = map(int, key.split("|"))
        by_gamma.setdefault(gamma, []).append((bucket, ms / n))
    total = sum(s.step_ms for s in steps)
    prefill = 0.0
    for s in steps:
        if s.prefill_tokens == 0:
            continue
        decode_ms = 0.0
        if s.batch_size and s.gamma in by_gamma:
            bucket = DEFAULT_BUCKETS[bucket_index(DEFAULT_BUCKETS, s.batch_size)]
            decode_ms = min(by_gamma[s.gamma], key=lambda c: abs(math.log(c[0] / bucket)))[1]
        prefill += max(0.0, s.step_ms - decode_ms)
    return prefill / total if total > 0 else 0.0
