"""Draft residency per worker: offload under sustained memory pressure, reload when it pays.

Pressure of a step = (requests waiting) and (KV used / KV total >= kv_full_fraction); each
worker keeps an exponential average p of it. With hysteresis and a minimum dwell:
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from nightjar.messages import Residency, StepStats


@dataclass(frozen=True)
class ResidencySettings:
    # A pool that limits admission read below 90% used in up to a third of its steps live (the next
    # prompt does not fit the free blocks, and preemptions free some), so at 0.9 the pressure average
    # hovered below offload_above through a minute-long burst (BENCHMARKS.md, sixteenth session).
    kv_full_fraction: float = 0.8
    pressure_smoothing: float = 0.02  # EMA weight per step: pressure must last ~1/this steps
    offload_above: float = 0.8
    offload_max_gain: float = 0.02  # offload only if speculation is predicted to gain <= 2% at the grown batch
    offload_min_gain: float = 0.02  # ... and γ=0 there to beat the best γ at today's batch by >= 2%
    kv_growth_prior: float = 1.5  # KV pool offloaded / resident before anything says otherwise
    reload_gain_under_pressure: float = 0.15  # ... and reload regardless of pressure above 15%
    reload_below: float = 0.2
    min_dwell_steps: int = 300
    reload_fit: float = 0.85  # used KV must fit in this share of the resident pool to reload
    reload_cost_ms: float = 150.0  # copy-back time of the draft, before measurements say otherwise
    gain_horizon_ms: float = 5000.0  # how long a reload is expected to keep paying
    block_tokens: int = 16  # tokens per KV block (to turn used blocks into catch-up tokens)
    forget_after_ms: int = 60_000  # a worker without a step for this long leaves the table

    def __post_init__(self) -> None:
        if not 0 < self.kv_full_fraction <= 1:
            raise ValueError(f"kv_full_fraction must be in (0, 1], got {self.kv_full_fraction}")
        if not 0 < self.pressure_smoothing <= 1:
            raise ValueError(f"pressure_smoothing must be in (0, 1], got {self.pressure_smoothing}")
        if not 0 <= self.offload_max_gain < self.reload_gain_under_pressure:
            raise ValueError("need 0 <= offload_max_gain < reload_gain_under_pressure (the hysteresis band)")
        if not 0 <= self.reload_below < self.offload_above <= 1:
            raise ValueError("need 0 <= reload_below < offload_above <= 1 (the hysteresis band)")
        if self.kv_growth_prior < 1:
            raise ValueError(f"kv_growth_prior must be >= 1, got {self.kv_growth_prior}")
        if self.min_dwell_steps < 0 or self.block_tokens < 1:
            raise ValueError("min_dwell_steps must be >= 0 and block_tokens >= 1")
        if self.forget_after_ms <= 0:
            raise ValueError(f"forget_after_ms must be > 0, got {self.forget_after_ms}")


@dataclass
class _WorkerState:
    residency: str = Residency.RESIDENT
    pressure: float = 0.0
    steps_since_change: int = 1 << 30
    resident_kv_total: int = 0  # KV blocks the worker had while the draft was resident
    offloaded_kv_total: int = 0  # ... and while it was offloaded
    offloads: int = 0
    reloads: int = 0
    last_step_ms: int = 0  # unix_ms of its latest step


@dataclass
class ResidencyController:
    """offload  if resident  and p >= offload_above
                 and gain(B') <= offload_max_gain
                 and offload gain(B → B') >= offload_min_gain
        reload   if offloaded and p <= reload_below  and used KV fits in reload_fit · resident pool
                 and gain · horizon_ms > reload_cost_ms + catch-up ms of its live tokens,
                 or, pressure or not, if gain >= reload_gain_under_pressure (a mistaken offload)

    where gain = 1 − L(γ*)/L(0) is the policy's predicted speed-up of speculation at a batch size,
    B' is the batch the freed memory admits (B' = min(B·growth, B + waiting, the worker's
    max_running), growth = KV pool offloaded / resident, measured after the first offload, from the
    worker's memory parts before it), and the offload gain is the predicted rise in tokens/s from
    γ = 0 at B' over the best γ at B. Offloading is this worker's choice of γ = 0 under memory
    pressure: it pays when the bigger batch at γ = 0 beats speculating at the batch memory allows
    now, even where speculation still pays a little at B (live, the KV pool capped the batch just
    below the crossover, and a rule that waited for γ = 0 at B never offloaded: BENCHMARKS.md, the
    headline). Where the step is compute-bound a bigger batch buys no throughput: it only moves
    waiting time into slower decoding for everyone, so the draft stays. And where speculation would
    pay again at B' (the next bucket up learned a γ > 0), the draft would be reloaded as soon as the
    batch grew.

    Both moves wait ``min_dwell_steps`` after the previous one and are checked every 16 steps, so
    the directive cannot flap. A worker whose steps stop for ``forget_after_ms`` (by the steps'
    own clock, checked every quarter of it) is forgotten: a dead one must not stay in every
    published policy, and a live one that idled that long has no pressure left, so "resident"
    (the default directive) is right for it.
    """

    settings: ResidencySettings = field(default_factory=ResidencySettings)
    workers: dict[str, _WorkerState] = field(default_factory=dict)
    _swept_ms: int = 0  # when workers were last checked for silence

    def directive(self, worker_id: str) -> str:
        state = self.workers.get(worker_id)
        return state.residency if state else Residency.RESIDENT

    def observe(self, stats: StepStats, gain: Callable[[int], float], offload_gain: Callable[[int, int], float],
                catchup_ms_per_token: float) -> None:
        s = self.settings
        w = self.workers.get(stats.worker_id)
        if w is None:  # (not setdefault: that would build a _WorkerState on every step)
            w = self.workers[stats.worker_id] = _WorkerState()
        w.last_step_ms = stats.unix_ms
        if stats.unix_ms - self._swept_ms >= s.forget_after_ms // 4:
            self._forget_silent(stats.unix_ms)
        total = stats.kv_blocks_used + stats.kv_blocks_free
        full = total > 0 and stats.kv_blocks_used >= s.kv_full_fraction * total
        w.pressure += s.pressure_smoothing * (float(full and stats.waiting > 0) - w.pressure)
        w.steps_since_change += 1
        if stats.draft_residency == Residency.RESIDENT and total > 0:
            w.resident_kv_total = total
        elif stats.draft_residency == Residency.OFFLOADED and total > 0:
            w.offloaded_kv_total = total
        if w.steps_since_change < s.min_dwell_steps or w.steps_since_change % 16:
            return  # both moves are slow decisions; checking every 16 steps keeps update() cheap
        if w.residency == Residency.RESIDENT:
            if w.pressure >= s.offload_above:
                b = stats.batch_size
                grown = self._grown_batch(w, stats)
                if gain(grown) > s.offload_max_gain or offload_gain(b, grown) < s.offload_min_gain:
                    return
                w.residency, w.steps_since_change = Residency.OFFLOADED, 0
                w.offloads += 1
            return
        if gain(stats.batch_size) >= s.reload_gain_under_pressure:
            # Speculation pays a lot even at this (larger) batch: the offload was a mistake or
            # the world changed; take the draft back even under pressure (the engine waits for
            # the used KV to fit the smaller pool).
            w.residency, w.steps_since_change = Residency.RESIDENT, 0
            w.reloads += 1
            return
        pool = w.resident_kv_total or total // 2
        if w.pressure > s.reload_below or stats.kv_blocks_used > s.reload_fit * pool:
            return
        catchup_ms = catchup_ms_per_token * stats.kv_blocks_used * s.block_tokens
        if gain(stats.batch_size) * s.gain_horizon_ms > s.reload_cost_ms + catchup_ms:
            w.residency, w.steps_since_change = Residency.RESIDENT, 0
            w.reloads += 1

    def _forget_silent(self, now_ms: int) -> None:
        self._swept_ms = now_ms
        horizon = now_ms - self.settings.forget_after_ms
        for wid in [wid for wid, w in self.workers.items() if w.last_step_ms < horizon]:
            del self.workers[wid]

    def _grown_batch(self, w: _WorkerState, stats: StepStats) -> int:
        """The batch the worker could run with the draft's memory handed to the KV cache."""
        if w.resident_kv_total and w.offloaded_kv_total:
            growth = w.offloaded_kv_total / w.resident_kv_total
        else:
            m = stats.memory_bytes
            kv = m.get("target_kv", 0) + m.get("draft_kv", 0)
            growth = 1 + m["draft_weights"] / kv if kv and m.get("draft_weights") else self.settings.kv_growth_prior
        b = stats.batch_size
        grown = min(max(b, round(b * growth)), b + stats.waiting)
        return min(grown, max(b, stats.max_running)) if stats.max_running else grown

    def state_dict(self) -> dict[str, Any]:
        return {wid: [w.residency, w.pressure, min(w.steps_since_change, 1 << 30), w.resident_kv_total,
                      w.offloads, w.reloads, w.offloaded_kv_total, w.last_step_ms] for wid, w in self.workers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for wid, row in state.items():
            # 6 or 7 fields: state saved before offloaded_kv_total / last_step_ms existed.
            if isinstance(row, list) and len(row) in (6, 7, 8) and row[0] in (Residency.RESIDENT, Residency.OFFLOADED):
                self.workers[str(wid)] = _WorkerState(str(row[0]), float(row[1]), int(row[2]), int(row[3]),
                                                      int(row[6]) if len(row) >= 7 else 0, int(row[4]), int(row[5]),
                                                      int(row[7]) if len(row) == 8 else 0)
