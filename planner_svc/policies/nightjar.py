"""``nightjar``: a contextual bandit over γ per batch-size bucket, with shared statistics.

Context: the batch-size bucket b (and, for residency, the worker's memory pressure). Arms:
γ ∈ {0..γmax}. Loss of arm γ in bucket b, in ms per emitted token:

    L(b, γ) = ( Σ_B p_b(B) · t̂(B, γ) + ĉ(b, γ) ) / ( Σ_B p_b(B) · B · Ê(γ) )
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nightjar.messages import StepStats
from planner_svc.policies.acceptance_estimate import AcceptanceEstimate, AcceptanceSettings
from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy, SurfacePrior, bucket_index
from planner_svc.policies.residency import ResidencyController, ResidencySettings
from planner_svc.policies.step_cost_model import StepCostModel, StepCostSettings


RECENT_DECAY = 0.999  # per policy step: a bucket's recent visits remember ~1,000 steps


@dataclass(frozen=True)
class NightjarSettings:
    bin_base: int = 8  # steps per bin in block 0, and per probe bin
    bin_max: int = 128
    bins_per_block: int = 8
    epsilon0: float = 0.2
    epsilon_min: float = 0.03
    probe_margin: float = 0.15  # only probe arms predicted within 15% of the greedy arm
    # Probes value an arm with acceptance raised by this many standard errors: one unlucky
    # first step at batch 1 must not price γ>0 out of ever being probed again (at γ=0 no
    # acceptance is observed, so a low estimate would never be corrected).
    probe_optimism: float = 2.0
    # ... and with its step time this share lower, over √(1 + the arm's recent plays here): a
    # shared machine drifts by more than arms differ, so an arm last measured in a slow minute
    # would otherwise stay overpriced while the others are re-measured every step.
    probe_cost_optimism: float = 0.15
    verify_plays: float = 4.0  # switch only to an arm with this many recent plays here, else probe it first
    min_plays: int = 8  # an arm with fewer plays in a bucket counts as uncertain
    stale_steps: int = 5000  # ... and so does one not played for this many bucket steps
    switch_margin: float = 0.03  # hysteresis: switch only for a predicted gain above 3% (live noise flips 1%)
    # A bucket takes its busier neighbour's γ when that is predicted within this of its own best:
    # a batch that hovers at a bucket boundary would otherwise switch γ at every crossing.
    table_margin: float = 0.03
    # A bucket visited in short spells (a closed loop's turnover dips the batch for a step or two)
    # plays the busiest bucket's γ unless its own saves more per visit than two switches cost,
    # each priced at this many of the busiest bucket's steps: the draft's catch-up, and at γ = 0
    # a cohort of requests that ended together and now ends apart (BENCHMARKS.md, the live planner).
    switch_cost_steps: float = 1.0
    probe_budget: float = 0.05  # a probe runs at full rate if it costs <= 5% of the next bin's time
    change_tolerance: float = 0.3
    change_min_tokens: int = 1024  # emitted tokens of exploit bins behind each change test
    initial_gamma: int = 1
    prior_block: int = 2  # a warm start (an offline surface) begins each bucket's schedule at this block
    # A prior measured elsewhere (the shipped surface, another CPU) is off by one factor for the
    # whole surface: the median of live ÷ prior over the first pure-decode steps rescales it,
    # when that is further than the tolerance from 1 (0 steps: never).
    prior_fit_steps: int = 16
    prior_fit_tolerance: float = 0.2
    offload: bool = True
    acceptance: AcceptanceSettings = field(default_factory=AcceptanceSettings)
    cost: StepCostSettings = field(default_factory=StepCostSettings)
    residency: ResidencySettings = field(default_factory=ResidencySettings)

    def __post_init__(self) -> None:
        if not 1 <= self.bin_base <= self.bin_max:
            raise ValueError(f"need 1 <= bin_base <= bin_max, got {self.bin_base}, {self.bin_max}")
        if (self.bins_per_block < 1 or self.min_plays < 0 or self.verify_plays < 0 or self.stale_steps < 1 or self.prior_block < 0
                or self.change_min_tokens < 0 or self.prior_fit_steps < 0 or self.prior_fit_tolerance < 0):
            raise ValueError("bins_per_block and stale_steps must be >= 1; min_plays, verify_plays, prior_block, "
                             "change_min_tokens, prior_fit_steps, prior_fit_tolerance >= 0")
        if not 0 <= self.epsilon_min <= self.epsilon0 <= 1:
            raise ValueError("need 0 <= epsilon_min <= epsilon0 <= 1")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        if (min(self.probe_margin, self.probe_optimism, self.switch_margin, self.table_margin, self.switch_cost_steps) < 0
                or self.change_tolerance <= 0 or self.initial_gamma < 0 or not 0 <= self.probe_cost_optimism < 1):
            raise ValueError("margins must be >= 0, change_tolerance > 0, initial_gamma >= 0, 0 <= probe_cost_optimism < 1")


class _Timeline:
    """One bucket's schedule and per-arm bookkeeping."""

    def __init__(self, lo: int, hi: int, arm: int, arms: int) -> None:
        self.lo, self.hi = lo, hi
        # Decayed counts of batch sizes lo..hi. A list: one cell changes every step, and a list
        # cell costs a fraction of a numpy one; support() turns it into an array when asked.
        self.hist = [0.0] * (hi - lo + 1)
        self.arm = arm  # arm in force
        self.follows: int | None = None  # the busier neighbouring bucket whose arm this one plays
        self.exploit_arm = arm  # arm to return to after a probe
        self.block = 0
        self.bin_index = 0
        self.steps_left = 1  # the first step seen in a bucket triggers a model-based choice
        self.probing = False
        self.steps = 0
        # Visits decayed by the policy's step clock (every bucket's steps count), so that which
        # neighbour is the busier one follows the load now, not the history: after an hour at one
        # client, batch 1 would otherwise lead batch 2 against 3-4 for good.
        self.recent = 0.0
        self.recent_at = 0
        self.entries = 0.0  # visits begun, decayed like ``recent``: recent / entries = steps per visit
        self.visit = 0  # steps of the visit in progress (of the worker that stepped here last)
        self.plays = [0] * arms
        self.last_played = [-(1 << 30)] * arms
        # Catch-up ms and plays per arm, both decayed per bucket step; ĉ = sum / (plays + 20), so an
        # arm not played for a while forgets a past switching cost instead of carrying it forever.
        self.catchup = [0.0] * arms
        self.recent_plays = [0.0] * arms
        self.hist_scale = self.catchup_scale = 1.0
        self.prefill = 0.0  # prompt tokens the target prefilled per step here, averaged over ~32 steps
        self.bin_ms = 0.0
        self.bin_tokens = 0.0
        self.bin_steps = 0
        self.bin_catchup_ms = 0.0
        self.predicted = 0.0  # predicted loss of the bin's arm when the bin began
        self.predicted_step_ms = 0.0  # ... and its step time (the loss times the tokens it expects)
        self.predicted_exploit = 0.0  # in a probe bin, the predicted loss of the arm in force when it began
        self.exploit_speed = 0.0  # the last exploit bin's step time over its prediction (0: none yet)
        self.judge_ms = self.judge_predicted_ms = self.judge_tokens = 0.0  # exploit bins since the last change test
        self._support: tuple[np.ndarray, np.ndarray] | None = None  # support(), until hist changes

    # Decay without touching every entry each step: new data is added with a weight that grows
    # by 1/decay per step, and everything is renormalised once the weight gets large.
    def observe(self, batch: int, gamma: int, catchup_ms: float) -> None:
        self._support = None
        hist_scale = self.hist_scale = self.hist_scale * (1.0 / 0.999)  # batch-size mix drifts: ~1000 steps
        self.hist[(batch if batch < self.hi else self.hi) - self.lo] += hist_scale
        scale = self.catchup_scale = self.catchup_scale * (1.0 / 0.995)  # switching costs: ~200 steps
        self.catchup[gamma] += catchup_ms * scale
        self.recent_plays[gamma] += scale
        if hist_scale > 1e9 or scale > 1e9:
            self.normalise()

    def normalise(self) -> None:
        self.hist = [h / self.hist_scale for h in self.hist]
        self._support = None
        self.catchup = [c / self.catchup_scale for c in self.catchup]
        self.recent_plays = [p / self.catchup_scale for p in self.recent_plays]
        self.hist_scale = self.catchup_scale = 1.0

    def visit_steps(self) -> float:
        """Steps per visit: the longer of the mean past visit and the one in progress; inf before
        a second visit (a new load level's first steps are no evidence of short visits)."""
        ended = self.entries - 1.0  # visits before the one in progress
        return max((self.recent - self.visit) / ended, self.visit) if ended >= 0.5 else math.inf

    def catchup_per_step(self, prompt_ms_per_token: float = 0.0) -> np.ndarray:
        """ĉ per arm, [γmax+1]: elementwise in Python (the same doubles), one array at the end.

        Each γ > 0 arm pays at least the draft's prefill of the prompts the target prefills here
        (``prompt_ms_per_token`` × the bucket's prompt tokens per step), played or not: under a
        queue of long prompts that is most of a step's catch-up, and an arm's own history, diluted
        by the 20-play prior, priced it at a quarter of that (BENCHMARKS.md, the live planner)."""
        prior = 20.0 * self.catchup_scale
        prompts = prompt_ms_per_token * self.prefill
        return np.array([max(c / (p + prior), prompts if g else 0.0)
                         for g, (c, p) in enumerate(zip(self.catchup, self.recent_plays))])

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        """Batch sizes of the bucket that matter [k] and their weights [k], summing to 1."""
        if self._support is None:  # a bin end asks up to three times between two observations
            self._support = self._compute_support()
        return self._support

    def _compute_support(self) -> tuple[np.ndarray, np.ndarray]:
        hist = np.array(self.hist)  # [hi - lo + 1]
        total = hist.sum()
        if total <= 0:  # not seen yet: the middle of the bucket (the open last one: up to 2×lo)
            return np.array([float((self.lo + min(self.hi, 2 * self.lo)) // 2)]), np.array([1.0])
        keep = np.flatnonzero(hist >= 0.02 * hist.max())
        return (keep + self.lo).astype(float), hist[keep] / hist[keep].sum()


class _PriorFit:
    """Live ÷ prior step time over a warm start's first pure-decode steps (``_rescale_prior``)."""

    def __init__(self, prior: SurfacePrior, steps: int) -> None:
        self.prior, self.steps = prior, steps
        self.log_sizes = np.log(np.array(prior.batch_sizes, dtype=float))  # [k]
        self.step_ms = np.array(prior.draft_ms) + np.array(prior.verify_ms)  # [k, γ+1]
        self.ratios: list[float] = []
        self.seen: list[StepStats] = []  # every step so far: replayed into a rescaled model

    def observe(self, stats: StepStats) -> bool:
        """Take one step; True when the fit is done (enough pure-decode steps, or too long without)."""
        self.seen.append(stats)
        b, g = stats.batch_size, stats.gamma
        if stats.prefill_tokens == 0 and stats.verify_ms > 0 and g < self.step_ms.shape[1] \
                and b <= self.prior.batch_sizes[-1]:
            predicted = float(np.interp(math.log(b), self.log_sizes, self.step_ms[:, g]))
            self.ratios.append((stats.draft_ms + stats.verify_ms) / predicted)
        return len(self.ratios) >= self.steps or len(self.seen) >= 16 * self.steps

    def scale(self) -> float:
        return float(np.median(self.ratios)) if self.ratios else 1.0


class NightjarPolicy(GammaPolicy):
    """with p_b the bucket's (decayed) batch-size histogram, t̂ the fitted step-cost model
    (StepCostModel), Ê the expected tokens per sequence from per-position acceptance
    (AcceptanceEstimate) and ĉ the measured catch-up ms per step when the arm is played, at least
    the draft's prefill of the prompt tokens the bucket's steps prefill (for γ > 0). Every
    step updates t̂ and Ê, which predict *every* arm, so no arm has to be played to be valued.

    Schedule (ADA-BinGreedy style, per bucket): the bucket's own steps form a timeline of blocks;
    block j has ``bins_per_block`` bins of min(bin_max, bin_base·2^j) steps. Decisions happen only
    at bin ends, so γ changes at most twice per bin (probe and return). At a bin end the next bin
    exploits argmin L, switching only if the gain beats ``switch_margin`` plus the expected draft
    catch-up C amortised over the bin's tokens (and only to an arm with ``verify_plays`` recent
    plays in the bucket: one measured long ago is probed first; and only if a probe that just
    measured it, priced at the step time it ran, confirms the gain), and takes the busier neighbouring
    bucket's γ when that is within ``table_margin`` (a batch hovering at a boundary does not flip
    γ), or the busiest bucket's where this one is visited in spells too short to pay for two
    switches (``switch_cost_steps``: a closed loop's turnover dips do not flip γ). With
    probability ε_j = max(ε_min, ε_0/(1+j)) it is instead a short probe bin (bin_base steps) of an
    uncertain arm (few plays here, or none for long) predicted within ``probe_margin`` of the greedy
    one; else, at rate ε_0, of an arm whose optimistic value beats the arm in force (of either
    kind, the one played least recently); else, at ε_min, of the neighbour γ±1 played least
    recently. Probes value arms optimistically: acceptance ``probe_optimism`` standard
    errors up, the step model's optimistic extrapolation, and a step time
    ``probe_cost_optimism``/√(1 + n) lower for an arm with n recent plays in the bucket. A probe
    whose predicted extra time (its excess loss, plus C when it turns the draft on, or the catch-up
    of its own steps when it turns the draft off) exceeds ``probe_budget`` of the next bin's time
    has its probability scaled by (budget/extra)², because at high load its stall also delays every
    queued request. C = measured ms per catch-up token × batch × lag, summed over workers, the lag
    being the γ=0 steps in a row each worker reports (its whole context after a long run). So at low
    load γ>0 keeps being probed and estimates keep refreshing (no deadlock at γ=0), while at high
    load a probe after a long γ=0 run is rare. Never-visited buckets start at the model's choice,
    capped by the next smaller bucket's γ; a bin whose observed loss misses its prediction by more
    than ``change_tolerance`` (over at least ``change_min_tokens`` tokens of exploit bins) restarts
    the bucket's schedule at block 0.
    """

    name = "nightjar"

    def __init__(self, settings: NightjarSettings = NightjarSettings(), *, gamma_max: int, seed: int = 0,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, max_batch: int | None = None) -> None:
        super().__init__(gamma_max=gamma_max, buckets=buckets)
        self.settings = settings
        self.seed = seed
        self.rng = random.Random(seed)
        self.acceptance = AcceptanceEstimate(gamma_max, settings.acceptance)
        self.cost = StepCostModel(settings.cost)
        self.residency_ctl = ResidencyController(settings.residency)
        top = max_batch or 4 * self.buckets[-1]
        arm0 = min(settings.initial_gamma, gamma_max)
        lows = (1,) + tuple(b + 1 for b in self.buckets[:-1])
        highs = self.buckets[:-1] + (max(top, self.buckets[-1]),)
        self.timelines = [_Timeline(lo, hi, arm0, gamma_max + 1) for lo, hi in zip(lows, highs)]
        # Bucket of every batch size up to the largest bound: select and update look it up on
        # every step, and a list index is a fraction of bisect's cost.
        self._bucket_of = [bucket_index(self.buckets, b) for b in range(highs[-1] + 1)]
        self._bucket_end = len(self._bucket_of)
        self._block_tokens = settings.residency.block_tokens
        # worker -> (γ=0 steps in a row, tokens per sequence, bucket of its last step, update no.,
        # steps in a row in that bucket)
        self.workers_lag: dict[str, tuple[int, float, int, int, int]] = {}
        self.updates = 0
        self.bins_ended = 0
        self.switches = 0  # table changes (bin decisions that changed a bucket's γ)
        self._prior_fit: _PriorFit | None = None  # a warm start's scale, while it is being measured

    def warm_start(self, prior: SurfacePrior) -> None:
        """Start the cost and acceptance models from an offline surface, and every bucket at the
        γ it predicts; live steps override both within a few dozen steps of a cell. Without a
        prior the policy starts at ``initial_gamma`` and learns everything online."""
        self._seed_cost(prior)
        if prior.acceptance:
            self.acceptance.seed(list(prior.acceptance))
        self._seed_unvisited()
        for tl in self.timelines:  # the model is already informed: explore as a few blocks in would
            tl.block = self.settings.prior_block
        self._prior_fit = _PriorFit(prior, self.settings.prior_fit_steps) if self.settings.prior_fit_steps else None

    def _rescale_prior(self, fit: _PriorFit) -> None:
        """The first pure-decode steps ran ``fit.scale()`` times the prior's figures (another
        machine, or the same one busier): seed a fresh cost model from the prior times that,
        then replay every step seen so far. Cells with live steps end as before; the arms and
        batch sizes not yet played are priced on this machine's scale instead of the prior's."""
        self.cost = StepCostModel(self.settings.cost)
        self._seed_cost(fit.prior, fit.scale())
        for st in fit.seen:
            self._observe_cost(st)

    def _seed_cost(self, prior: SurfacePrior, scale: float = 1.0) -> None:
        self.cost.seed(list(prior.batch_sizes), [[d * scale for d in r] for r in prior.draft_ms],
                       [[v * scale for v in r] for r in prior.verify_ms])

    # --- select --------------------------------------------------------------------------------
    def gamma_for(self, batch_size: int) -> int:
        if 0 <= batch_size < self._bucket_end:
            return self.timelines[self._bucket_of[batch_size]].arm
        return self.timelines[bucket_index(self.buckets, batch_size)].arm

    def residency_for(self, worker_id: str) -> str:
        return self.residency_ctl.directive(worker_id) if self.settings.offload else "resident"

    def residency(self) -> dict[str, str]:
        if not self.settings.offload:
            return {}
        return {wid: w.residency for wid, w in self.residency_ctl.workers.items()}

    # --- predictions ---------------------------------------------------------------------------
    def losses(self, bucket: int, optimism: float = 0.0) -> np.ndarray:
        """Predicted ms per emitted token of every arm in one bucket, shape [γmax+1]; with
        ``optimism`` > 0, at acceptance that many standard errors above its estimate and at the
        step model's optimistic extrapolation."""
        tl = self.timelines[bucket]
        sizes, weights = tl.support()
        step = (weights @ self.cost.step_ms(sizes, self.gamma_max, optimism > 0)
                + tl.catchup_per_step(self.cost.catchup_ms_per_token()))  # [G+1]
        expected = self.acceptance.optimistic_tokens(optimism) if optimism else self.acceptance.expected_tokens()
        tokens = float(weights @ sizes) * np.asarray(expected)  # [G+1]
        return step / tokens

    def gain(self, batch_size: int) -> float:
        """Predicted fractional speed-up of the best γ over γ=0 at this batch size."""
        if not self.cost.ready:
            return 0.0
        loss = self.losses(bucket_index(self.buckets, batch_size))
        return float(max(0.0, 1.0 - loss.min() / loss[0]))

    def offload_gain(self, batch_size: int, larger: int) -> float:
        """Predicted fractional rise in tokens/s from γ=0 at ``larger`` sequences over the best
        γ at ``batch_size``: what handing the draft's memory to the KV cache buys."""
        if not self.cost.ready or larger <= batch_size:
            return 0.0
        step = self.cost.step_ms(np.array([batch_size, larger], dtype=float), self.gamma_max)  # [2, G+1] ms
        now = float((batch_size * np.asarray(self.acceptance.expected_tokens()) / np.maximum(step[0], 1e-9)).max())
        return float(larger / max(step[1, 0], 1e-9) / now - 1.0)

    # --- update --------------------------------------------------------------------------------
    def update(self, stats: StepStats) -> None:
        b, g = stats.batch_size, stats.gamma
        verify_ms, draft_ms, catchup_ms = stats.verify_ms, stats.draft_ms, stats.catchup_ms
        if (b <= 0 or not 0 <= g <= self.gamma_max or not 0 <= verify_ms < math.inf
                or not 0 <= draft_ms < math.inf or not 0 <= catchup_ms < math.inf):
            return  # a malformed record (NaN fails both bounds) must not poison the shared models
        self.updates += 1
        if g > 0 and stats.accepted_per_position:
            self.acceptance.observe(b, g, stats.accepted_per_position)
        decode_measured = self._observe_cost(stats)
        fit = self._prior_fit
        if fit is not None and fit.observe(stats):
            self._prior_fit = None
            if abs(math.log(fit.scale())) > math.log(1.0 + self.settings.prior_fit_tolerance):
                self._rescale_prior(fit)
        prefill_tokens = stats.prefill_tokens
        bucket = self._bucket_of[b] if b < self._bucket_end else bucket_index(self.buckets, b)
        tl = self.timelines[bucket]
        run, _, zero_bucket, _, visit = self.workers_lag.get(stats.worker_id, (0, 0.0, bucket, 0, 0))
        visit = visit + 1 if zero_bucket == bucket else 1
        tokens_per_seq = stats.kv_blocks_used * self._block_tokens / b
        self.workers_lag[stats.worker_id] = (run + 1 if g == 0 else 0, tokens_per_seq, bucket, self.updates, visit)
        # Who pays a catch-up: after steady speculation it is the draft prefilling new prompts, a
        # running cost of this arm; after a γ=0 run in another bucket it is this arm too, the
        # switch having happened at this batch (a batch that dips for a step below a bucket at
        # γ=0 and speculates there pays the whole context's catch-up each time); after a γ=0 run
        # in this bucket it is this bucket's own switch, which the decision rules already price
        # (amortised catch-up), so no arm is charged.
        tl.observe(b, g, catchup_ms if run == 0 or zero_bucket != bucket else 0.0)
        tl.prefill += (prefill_tokens - tl.prefill) / min(tl.steps + 1, 32)  # (a mean over the first 32)
        steps = tl.steps = tl.steps + 1
        decay = RECENT_DECAY ** (self.updates - tl.recent_at)
        tl.recent = tl.recent * decay + 1.0
        tl.entries = tl.entries * decay + (visit == 1)
        tl.recent_at = self.updates
        tl.visit = visit
        tl.plays[g] += 1
        tl.last_played[g] = steps
        if g == tl.arm and decode_measured:
            # the bin's observed loss, prefill rows taken out as the prediction does (a step
            # that is mostly prefill would measure c's error instead)
            prefill_ms = self.cost.prefill_ms_per_token * prefill_tokens
            tl.bin_ms += draft_ms + max(verify_ms - prefill_ms, 0.0) + catchup_ms
            emitted = stats.emitted_tokens
            tl.bin_tokens += emitted if emitted > 1 else 1
            tl.bin_steps += 1
            tl.bin_catchup_ms += catchup_ms
        tl.steps_left -= 1
        if visit == 1 and tl.follows is None and tl.visit_steps() < self.settings.bin_base:
            # Visited in short spells: decide at a visit's first step whether to follow the
            # busiest bucket, not once per bin of its own steps (thousands of the batch's steps
            # for a turnover dip).
            tl.steps_left = 0
        if tl.steps_left <= 0:
            self._end_bin(tl, bucket)
        if self.settings.offload:
            self.residency_ctl.observe(stats, self.gain, self.offload_gain, self.cost.catchup_ms_per_token())

    def _observe_cost(self, stats: StepStats) -> bool:
        """Teach the cost model one step; False where its prefill dominated it (its decode rows
        were not measured: ``StepCostModel.observe_mixed``)."""
        b, g = stats.batch_size, stats.gamma
        measured = True
        if stats.prefill_tokens > 0:  # the target forward also prefilled new prompts
            measured = self.cost.observe_mixed(b, g, stats.draft_ms, stats.verify_ms, stats.prefill_tokens)
        elif stats.verify_ms > 0:
            self.cost.observe(b, g, stats.draft_ms, stats.verify_ms)
        if stats.catchup_tokens > 0:
            self.cost.observe_catchup(stats.catchup_tokens, stats.catchup_ms)
        return measured

    def _end_bin(self, tl: _Timeline, bucket: int) -> None:
        s = self.settings
        old = tl.arm
        if not self.cost.ready:
            tl.steps_left = s.bin_base
            return
        loss = self.losses(bucket)
        if not tl.probing and tl.bin_steps >= s.bin_base // 2 and tl.predicted_step_ms > 0:
            tl.exploit_speed = self._speed(tl)
        if not tl.probing and tl.bin_tokens > 0 and tl.predicted > 0:
            # Judged over at least change_min_tokens: a short bin at a small batch misses its
            # prediction by 30% on acceptance luck alone, and each restart means 8-step bins
            # with ε = 0.2 again (BENCHMARKS.md, the live planner).
            tl.judge_ms += tl.bin_ms
            tl.judge_predicted_ms += tl.predicted * tl.bin_tokens
            tl.judge_tokens += tl.bin_tokens
            if tl.judge_tokens >= s.change_min_tokens:
                if abs(tl.judge_ms / tl.judge_predicted_ms - 1.0) > s.change_tolerance:
                    tl.block, tl.bin_index = 0, 0  # the world moved: explore again from the start
                tl.judge_ms = tl.judge_predicted_ms = tl.judge_tokens = 0.0
        choice, verify = self._exploit_choice(tl, loss), None
        if tl.probing and choice == tl.arm != tl.exploit_arm and not self._probe_confirms(tl, loss):
            choice = tl.exploit_arm
        if (choice != tl.exploit_arm and tl.follows is None
                and tl.recent_plays[choice] < s.verify_plays * tl.catchup_scale):
            # Measured too long ago to switch on: on a shared machine its figure may be from a
            # faster or slower minute than the arm in force. Probe it first; switch at the next
            # bin end if it still wins. Not where the arm in force was a leader's: nothing here
            # chose it, and live the probe's detour held a spike at the γ = 1 of the quiet
            # batch sizes for ~50 steps (BENCHMARKS.md, the live planner).
            choice, verify = tl.exploit_arm, choice
        tl.exploit_arm, tl.follows = self._follow_neighbour(tl, bucket, loss, choice)
        # A bucket that follows a busier one plays that bucket's arm, probes included, and does
        # not probe itself: its visits are the boundary crossings, and the shared models already
        # learn from the busier bucket's steps. Nor does one visited in short spells: a probe bin
        # of its own steps spans many visits, two switches each.
        probe = None if tl.follows is not None or tl.visit_steps() < s.bin_base else (
            verify if verify is not None else self._probe_choice(tl, loss, self._hopeful(tl, bucket)))
        if probe is not None:
            tl.arm, tl.probing, tl.steps_left = probe, True, s.bin_base
        else:
            tl.arm, tl.probing = tl.exploit_arm, False
            tl.steps_left = min(s.bin_max, s.bin_base << min(tl.block, 20))
        if tl.follows is not None:
            tl.arm = self.timelines[tl.follows].arm
            # A follower decides again after a short bin: when the load moves to it, its visits
            # lengthen and its own γ should start within steps, not after its schedule's bin.
            tl.steps_left = s.bin_base
        self._sync_followers(bucket)
        tl.bin_index += 1
        if tl.bin_index >= s.bins_per_block:
            tl.block, tl.bin_index = tl.block + 1, 0
        tl.bin_ms = tl.bin_tokens = tl.bin_catchup_ms = 0.0
        tl.bin_steps = 0
        tl.predicted = float(loss[tl.arm])
        tl.predicted_exploit = float(loss[tl.exploit_arm])
        sizes, weights = tl.support()
        tl.predicted_step_ms = tl.predicted * float(weights @ sizes) * self.acceptance.expected_tokens()[tl.arm]
        if tl.arm != old:
            self.switches += 1
        if self.bins_ended % 8 == 0:
            self._seed_unvisited()
        self.bins_ended += 1

    def _probe_confirms(self, tl: _Timeline, loss: np.ndarray) -> bool:
        """Whether the probe bin just ended beats the arm in force, each priced at the speed it ran.

        The machine drifts by more than arms differ, and the model alone compares an arm measured
        now with one measured minutes ago (live at 16 clients: γ = 1 measured in a slow minute
        against γ = 2's figure from a fast one). Nor is the arm in force's loss after the probe a
        fair reference: the probe's steps also move the terms the arms share (r(B)), so a probe
        that ran slow raised the arm in force's price with its own (live at 4 clients: one slow
        probe of γ = 4 moved the planner off γ = 2, 8% faster, for good). So both are taken as
        predicted when the probe began, the probe's scaled by its step time over the prediction,
        against the same ratio of the exploit bin just before it: the machine's speed that minute
        cancels. Tokens are the model's, so a short bin's acceptance luck does not count; catch-up
        is left out of both (``_exploit_choice`` prices it)."""
        s = self.settings
        if tl.bin_steps < s.bin_base // 2 or tl.predicted_step_ms <= 0:
            return True  # too few steps to tell: the model decides
        if tl.exploit_speed <= 0:  # no exploit bin measured yet: against the model's price now
            return tl.predicted * self._speed(tl) * (1.0 + s.switch_margin) < loss[tl.exploit_arm]
        return tl.predicted * self._speed(tl) / tl.exploit_speed * (1.0 + s.switch_margin) < tl.predicted_exploit

    @staticmethod
    def _speed(tl: _Timeline) -> float:
        """The bin's step time, catch-up left out, over the one predicted when it began."""
        return (tl.bin_ms - tl.bin_catchup_ms) / tl.bin_steps / tl.predicted_step_ms

    def _seed_unvisited(self) -> None:
        """Start never-visited buckets at the model's choice instead of the prior, capped by the
        next smaller bucket's γ (the best γ does not grow with batch size), so a first visit
        at high load does not turn speculation on, and pay a catch-up, on extrapolation alone."""
        cap = self.gamma_max
        for i, other in enumerate(self.timelines):
            if other.steps == 0:
                other.arm = other.exploit_arm = min(int(np.argmin(self.losses(i))), cap)
            cap = other.arm

    def _catchup_ms(self, batch: float) -> float:
        """Expected draft catch-up if speculation turned on now, summed over the workers.

        A sequence decoded at γ=0 for r steps lags r tokens, and one that joined during the run
        lags its whole context (the draft never saw its prompt); past a short run (16 steps) the
        whole context is the estimate, so probing after a long γ=0 run at high load is priced
        at its real cost. Every worker pays its own catch-up. Optimistic (0) until measured.
        """
        recent = self.updates - 5000  # a worker silent this long is gone (or idle: no lag)
        lag = sum(min(run, ctx) if run < 16 else ctx for run, ctx, _, seen, _ in self.workers_lag.values() if seen > recent)
        return self.cost.catchup_ms_per_token() * batch * lag

    def _exploit_choice(self, tl: _Timeline, loss: np.ndarray) -> int:
        s = self.settings
        current = tl.exploit_arm
        best = int(np.argmin(loss))
        cost = loss[best] * (1.0 + s.switch_margin)
        if current == 0 and best > 0:
            # Turning speculation on costs a draft catch-up; amortise it over the next bin.
            sizes, weights = tl.support()
            batch = float(weights @ sizes)
            tokens = min(s.bin_max, s.bin_base << min(tl.block, 20)) * batch * self.acceptance.expected_tokens()[best]
            cost += self._catchup_ms(batch) / max(tokens, 1.0)
        return best if cost < loss[current] else current

    def _follow_neighbour(self, tl: _Timeline, bucket: int, loss: np.ndarray, own: int) -> tuple[int, int | None]:
        """(γ, leader): the busier neighbouring bucket's γ and index where its γ costs at most
        ``table_margin`` here, else the busiest bucket's where this one is visited in short spells
        (``_follow_busiest``), else (this bucket's own choice, None)."""
        near = [i for i in (bucket - 1, bucket + 1) if 0 <= i < len(self.timelines)]
        leader = max(near, key=lambda i: self._recent(self.timelines[i]), default=None)
        if (leader is not None and self.timelines[leader].follows != bucket
                and self._recent(self.timelines[leader]) > self._recent(tl)):
            ref = self.timelines[leader].exploit_arm
            if loss[ref] <= loss[own] * (1.0 + self.settings.table_margin):
                return ref, leader
        return self._follow_busiest(tl, bucket, loss, own)

    def _follow_busiest(self, tl: _Timeline, bucket: int, loss: np.ndarray, own: int) -> tuple[int, int | None]:
        """(the busiest bucket's γ, its index) where playing this bucket's own γ saves less per
        visit than a switch there and one back cost, else (own, None).

        A visit of k steps at the busiest bucket's γ r instead of its own emits k·B·E(r) tokens,
        each (L(r) − L(own)) ms dearer; the two switches cost ``switch_cost_steps`` of the busiest
        bucket's steps each. k is the longer of the mean past visit and the one in progress, so
        a bucket the load has just moved to (one long visit) plays its own γ from its next bin end.
        Live at 16 clients, the turnover dips (batch 3-8 for one or two steps every ~64) ran
        γ = 2-4 beside γ = 0 at batch 9-16: 32 switches per 1,000 steps, a cohort desynchronised."""
        timelines = self.timelines
        busiest = max(range(len(timelines)), key=lambda i: self._recent(timelines[i]))
        lead = timelines[busiest]
        # A busiest bucket not stepped in lately is the load before a change, not where this
        # bucket's visits return to: after a drop from 48 clients to 1, its γ = 0 would hold.
        if busiest == bucket or lead.follows is not None or self.updates - lead.recent_at > 4 * self.settings.bin_base:
            return own, None
        visit = tl.visit_steps()
        if visit == math.inf:
            return own, None
        ref = lead.exploit_arm
        expected = self.acceptance.expected_tokens()
        sizes, weights = tl.support()
        saving = visit * float(weights @ sizes) * expected[ref] * float(loss[ref] - loss[own])  # ms per visit
        lead_sizes, lead_weights = lead.support()
        lead_step = float(self.losses(busiest)[ref]) * float(lead_weights @ lead_sizes) * expected[ref]
        if saving <= 2.0 * self.settings.switch_cost_steps * lead_step:
            return ref, busiest
        return own, None

    def _sync_followers(self, bucket: int) -> None:
        """Followers (and theirs) switch with their leader, not at their next bin end."""
        todo, done = [bucket], {bucket}
        while todo:
            leader = todo.pop()
            for i, other in enumerate(self.timelines):
                if other.follows == leader and i not in done:
                    other.arm = self.timelines[leader].arm
                    done.add(i)
                    todo.append(i)

    def _recent(self, tl: _Timeline) -> float:
        """The bucket's visits, decayed to now."""
        return tl.recent * RECENT_DECAY ** (self.updates - tl.recent_at)

    def _hopeful(self, tl: _Timeline, bucket: int) -> np.ndarray:
        """The arms' optimistic losses (``probe_optimism``, ``probe_cost_optimism``), [γmax+1]."""
        plays = np.asarray(tl.recent_plays) / tl.catchup_scale  # [G+1], decayed like the catch-up
        return self.losses(bucket, self.settings.probe_optimism) * (1.0 - self.settings.probe_cost_optimism / np.sqrt(1.0 + plays))

    def _probe_choice(self, tl: _Timeline, loss: np.ndarray, hopeful: np.ndarray) -> int | None:
        """``hopeful``: the arms' optimistic losses (``_hopeful``)."""
        s = self.settings
        base = tl.exploit_arm
        eps = max(s.epsilon_min, s.epsilon0 / (1 + tl.block))
        uncertain = [a for a in range(self.gamma_max + 1) if a != base
                     and (tl.plays[a] < s.min_plays or tl.steps - tl.last_played[a] > s.stale_steps)
                     and hopeful[a] <= loss[base] * (1.0 + s.probe_margin)]
        near = [a for a in (base - 1, base + 1) if 0 <= a <= self.gamma_max]
        promising = [a for a in range(self.gamma_max + 1) if a != base and hopeful[a] < loss[base]]
        if uncertain or promising:
            # An arm barely measured here first, else one that may beat the arm in force on what
            # is known of it so far. Among them the one played least recently goes first: always
            # the most hopeful one starved the others, since an optimistic acceptance keeps a deep
            # γ the most hopeful arm at any batch (live at 48 clients, γ = 0, priced in the load
            # jump, was never probed again while γ = 2 and 3 were).
            arm = min(uncertain or promising, key=lambda a: (tl.last_played[a], hopeful[a]))
            if 0 < arm < base and tl.plays[arm] == 0 and hopeful[arm] < loss[base]:
                # A shallower γ never measured here that may beat the arm in force: its figure is
                # all extrapolation (from other batch sizes, where the best γ is deeper), so one
                # probe bin now. At ε/(1 + block), with bins of 64+ steps, a warm-started bucket
                # waited thousands of steps for it (live at 4 clients: the one-client γ = 4 held
                # while γ = 2 and 3, 8% faster, were never tried). Not γ = 0, whose probe pays a
                # catch-up on the way back, nor a deeper γ: forced there, one probe at 48 clients
                # on a drifting machine held γ = 2 for a third of the run (the regime tests).
                eps = 1.0
            elif not uncertain:
                # A promising arm is probed at the schedule's full rate: at batch 1 a deeper γ's
                # last acceptance position is learned only from its own probes, a few trials
                # each, and at ε_min it stayed underrated (the budget below still holds the rate
                # down where probes are dear).
                eps = max(eps, s.epsilon0)
        else:
            if not near:
                return None
            # The neighbour played least recently: always the cheaper-looking one would leave the
            # other's estimate stale for good (an overpriced arm is never retried).
            arm = min(near, key=lambda a: tl.last_played[a])
            eps = s.epsilon_min
        # Probe at full rate only while it is cheap: its predicted extra time (worse arm for one
        # short bin, plus the catch-up when it turns the draft on) within probe_budget of the
        # next exploit bin's time. At low load that holds, so γ>0 keeps being probed (no
        # deadlock at γ=0); at high load a probe after a long γ=0 run is rare.
        sizes, weights = tl.support()
        batch = float(weights @ sizes)
        expected = self.acceptance.expected_tokens()
        extra = max(hopeful[arm] - loss[base], 0.0) * s.bin_base * batch * expected[arm]
        if base == 0 and arm > 0:
            extra += self._catchup_ms(batch)
        elif arm == 0:  # the return to base pays the draft's catch-up over the probe's steps
            extra += self.cost.catchup_ms_per_token() * batch * s.bin_base
        budget = s.probe_budget * min(s.bin_max, s.bin_base << min(tl.block, 20)) * batch * expected[base] * loss[base]
        if extra > budget:  # quadratic: a dear probe's stall also delays everyone queued behind it
            eps *= (budget / extra) ** 2
        return arm if self.rng.random() < eps else None

    # --- persistence ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        for t in self.timelines:
            t.normalise()
        return {
            "updates": self.updates, "switches": self.switches,
            "acceptance": self.acceptance.state_dict(), "cost": self.cost.state_dict(),
            "residency": self.residency_ctl.state_dict(),
            "timelines": [{"arm": t.arm, "exploit_arm": t.exploit_arm, "block": t.block, "bin_index": t.bin_index,
                           "steps": t.steps, "plays": t.plays, "last_played": t.last_played,
                           "catchup": t.catchup, "recent_plays": t.recent_plays, "hist": list(t.hist),
                           "recent": [t.recent, t.recent_at, t.entries], "prefill": t.prefill} for t in self.timelines],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prior_fit = None  # the saved model was learned live: nothing to rescale
        self.updates = int(state.get("updates", 0))
        self.switches = int(state.get("switches", 0))
        self.rng = random.Random(self.seed * 1_000_003 + self.updates)  # fresh but reproducible stream
        self.acceptance.load_state_dict(state.get("acceptance", {}))
        self.cost.load_state_dict(state.get("cost", {}))
        self.residency_ctl.load_state_dict(state.get("residency", {}))
        rows = state.get("timelines", [])
        if len(rows) != len(self.timelines):
            return  # bucket layout changed: keep the learned models, restart the schedules
        arms = self.gamma_max + 1
        for tl, row in zip(self.timelines, rows):
            if len(row.get("plays", ())) != arms or len(row.get("hist", ())) != len(tl.hist):
                continue
            tl.arm = min(int(row["arm"]), self.gamma_max)
            tl.exploit_arm = min(int(row["exploit_arm"]), self.gamma_max)
            tl.block, tl.bin_index, tl.steps = int(row["block"]), int(row["bin_index"]), int(row["steps"])
            tl.plays = [int(x) for x in row["plays"]]
            tl.last_played = [int(x) for x in row["last_played"]]
            tl.catchup = [float(x) for x in row["catchup"]]
            tl.recent_plays = [float(x) for x in row.get("recent_plays", [0.0] * arms)]
            recent, recent_at, entries = (list(row.get("recent", [])) + [0.0, 0, 0.0])[:3]  # older: no entries
            tl.recent, tl.recent_at, tl.entries = float(recent), int(recent_at), float(entries)
            tl.hist = [float(x) for x in row["hist"]]
            tl.prefill = float(row.get("prefill", 0.0))
            tl._support = None
