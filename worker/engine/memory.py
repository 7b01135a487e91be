"""MemoryManager: the draft's residency, offload (expand) and reload (squeeze), in the device budget.

Every part of the budget (budget.py) is counted all the time, and no transition ever leaves
their sum above it. Residency moves through

    resident --offload()--> offloading --copy done--> offloaded --reload()--> reloading --copy done--> resident
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from nightjar.messages import Residency
from worker.engine.budget import MemoryParts, kv_pool_bytes, workspace_of
from worker.engine.draft_mover import DraftMover, Transfer

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.runner import ModelRunner
    from worker.engine.scheduler import Scheduler

log = logging.getLogger("nightjar.memory")

DIRECTIVES = (Residency.RESIDENT.value, Residency.OFFLOADED.value)


@dataclass(frozen=True)
class MemoryReport:
    state: str  # resident | offloading | offloaded | reloading | none
    directive: str  # what the manager is working towards
    parts: MemoryParts
    target_blocks: int  # current target pool size
    base_blocks: int  # its size while the draft is resident
    draft_blocks: int
    last_offload: Transfer | None
    last_reload: Transfer | None
    offloads: int
    reloads: int
    refusals: int  # reloads refused because they would have forced preemption
    last_refusal: str | None
    last_migrated_blocks: int  # live target blocks moved by the last squeeze
    last_resize_ms: float  # time the last pool reallocation (grow or squeeze) took on the engine thread


@dataclass(frozen=True)
class MemoryPressure:
    """What a directive callback sees each step."""

    state: str
    running: int
    waiting: int  # requests still waiting after the last step admitted what it could
    blocks_used: int
    blocks_total: int
    base_blocks: int


class MemoryManager:
    """- offload (expand): γ is 0 from the next step (``state`` is no longer "resident"); every
      sequence's draft KV is dropped and the draft pool tensor freed; the weights are copied to
      host (async on CUDA); once the copy is done the device weights are freed and the target
      pool grows by every byte that left. Running sequences keep their blocks
      and the next step runs as usual, only with γ = 0.
    - reload (squeeze): refused (and counted) when the running sequences' next step would not
      fit in the smaller pool — shrinking then would force preemption. Otherwise live target blocks
      above the base size are migrated below it (block tables updated), the pools are reallocated
      at their base sizes, and the weights are copied back (async on CUDA). Only when the copy is
      done does the residency become "resident", so γ > 0 resumes; every sequence's draft KV is
      then rebuilt by the proposer's catch-up (its ``draft_computed`` was reset to 0).

    Directives: ``set_directive("resident" | "offloaded")`` (the planner's policy through the
    worker service) or a callback polled each step (``set_directive_source``). The manager keeps
    pursuing the last directive: a refused reload is retried each step until it is safe, which is
    "wait until the blocks are free", never preemption.

    The manager runs on the engine's thread, between steps (``poll`` is the first thing a step does).
    The engine owns it and hands it its parts: the two runners, the scheduler (whose sequences
    hold the block tables it migrates or drops) and ``waiting``, the requests left waiting after
    the last step. ``state`` is the one record of the draft's residency; the engine reads it.
    """

    def __init__(self, cfg: "EngineConfig", target: "ModelRunner", draft: "ModelRunner | None",
                 scheduler: "Scheduler", waiting: Callable[[], int]) -> None:
        self.target = target
        self.draft = draft
        self.scheduler = scheduler
        self._waiting = waiting
        self.gamma_max = cfg.gamma_max
        self.workspace = workspace_of(cfg, self.target.model)
        self.target_bpb = self.target.kv.nbytes // self.target.kv.num_blocks
        self.base_blocks = self.target.kv.num_blocks
        self.mover = DraftMover(draft.model) if draft is not None else None
        self.draft_bpb = draft.kv.nbytes // draft.kv.num_blocks if draft is not None else 0
        # The target's weights never move; summing ~100 tensor sizes on every step's snapshot did show.
        self.target_weight_bytes = self.target.model.weight_bytes
        draft_model = draft.model if draft is not None else None
        weights = self.target_weight_bytes + (draft_model.weight_bytes if draft_model is not None else 0)
        # everything configured; block rounding leaves the pools a little under it
        self.budget = weights + kv_pool_bytes(cfg, self.target.model, draft_model) + self.workspace
        self.state = Residency.RESIDENT if draft is not None else Residency.NONE
        self.directive = self.state
        self._source: Callable[[MemoryPressure], str] | None = None
        self.last_offload: Transfer | None = None
        self.last_reload: Transfer | None = None
        self.offloads = self.reloads = self.refusals = 0
        self.last_refusal: str | None = None
        self._refused_now = False  # the current directive's reload was refused (count it once)
        self.last_migrated_blocks = 0
        self.last_resize_ms = 0.0
        self._check()

    # ------------------------------------------------------------------ accounting

    def _measure(self) -> MemoryParts:
        return MemoryParts(
            budget=getattr(self, "budget", 0),
            target_weights=self.target_weight_bytes,
            draft_weights=self.mover.device_bytes if self.mover else 0,
            target_kv=self.target.kv.nbytes,
            draft_kv=self.draft.kv.nbytes if self.draft else 0,
            workspace=self.workspace,
        )

    def parts(self) -> MemoryParts:
        return self._measure()

    def _check(self) -> None:
        p = self._measure()
        assert p.total <= p.budget, f"memory accounting over budget: {p}"
        assert self.target.blocks.num_blocks == self.target.kv.num_blocks

    def report(self) -> MemoryReport:
        return MemoryReport(
            state=self.state, directive=self.directive, parts=self._measure(),
            target_blocks=self.target.kv.num_blocks, base_blocks=self.base_blocks,
            draft_blocks=self.draft.kv.num_blocks if self.draft else 0,
            last_offload=self.last_offload, last_reload=self.last_reload, offloads=self.offloads,
            reloads=self.reloads, refusals=self.refusals, last_refusal=self.last_refusal,
            last_migrated_blocks=self.last_migrated_blocks, last_resize_ms=self.last_resize_ms)

    # ------------------------------------------------------------------ directives

    @torch.inference_mode()  # the pools and weights it makes are used only inside the step's inference mode
    def set_directive(self, directive: str) -> None:
        """"resident" or "offloaded"; carried out now as far as it can be, then pursued each step."""
        self._adopt(directive)
        self.poll()

    def _adopt(self, directive: str) -> None:
        if directive not in DIRECTIVES:
            raise ValueError(f"draft residency directive {directive!r}: use one of {DIRECTIVES}")
        if self.draft is None:
            return  # no draft: nothing to move
        if directive != self.directive:
            self._refused_now = False
        self.directive = directive

    def set_directive_source(self, fn: Callable[[MemoryPressure], str] | None) -> None:
        """A callback asked for the directive every step (a local pressure rule until the planner's policy)."""
        self._source = fn

    def pressure(self) -> MemoryPressure:
        b = self.target.blocks
        # requests still waiting after the last step's admission (not ones that just arrived)
        return MemoryPressure(self.state, len(self.scheduler.running), self._waiting(), b.num_used,
                              b.num_blocks, self.base_blocks)

    @torch.inference_mode()
    def poll(self) -> None:
        """Between steps: finish a completed transfer, then move towards the directive."""
        if self.draft is None:
            return
        if self._source is not None:
            self._adopt(self._source(self.pressure()))
        done = self.mover.poll()
        if done is not None:
            self._finish(done)
        if self.directive == Residency.OFFLOADED and self.state == Residency.RESIDENT:
            self._offload()
        elif self.directive == Residency.RESIDENT and self.state == Residency.OFFLOADED:
            self._reload()

    def wait(self) -> None:
        """Block until a transfer in flight is done and finish it (tests and scripts; the engine polls)."""
        if self.mover is not None and self.mover.busy:
            done = self.mover.wait()
            if done is not None:
                self._finish(done)

    # ------------------------------------------------------------------ offload (expand)

    @torch.inference_mode()
    def offload(self) -> bool:
        """Directive "offloaded", started now; False if the draft was not resident (nothing started)."""
        if self.draft is None:
            return False
        self._adopt(Residency.OFFLOADED)
        return self._offload()

    def _offload(self) -> bool:
        if self.state != Residency.RESIDENT:
            return False
        self.state = Residency.OFFLOADING
        dblocks = self.draft.blocks
        self.scheduler.drop_draft_kv()  # dropped wholesale; the catch-up rebuilds it after the reload
        assert dblocks.num_used == 0, "a draft block is held by a sequence the scheduler does not know"
        self.draft.kv.resize(0)  # the draft pool tensor is freed now
        dblocks.apply_shrink(0, {}, [])
        self.mover.start_offload()
        self._check()
        done = self.mover.poll()  # on CPU the copy is already done
        if done is not None:
            self._finish(done)
        return True

    def _grow_target(self) -> None:
        t0 = time.perf_counter()
        p = self._measure()
        extra = p.free // self.target_bpb
        if extra > 0:
            n = self.target.kv.num_blocks + extra
            self.target.kv.resize(n)
            self.target.blocks.grow(n)
        self.last_resize_ms = (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ reload (squeeze)

    @torch.inference_mode()
    def reload(self) -> str | None:
        """Directive "resident", started now if safe. -> None when started (or nothing to do), else
        why it was refused (the directive stays: it is retried each step until it is safe)."""
        if self.draft is None:
            return None
        self._adopt(Residency.RESIDENT)
        return self._reload()

    def _reload(self) -> str | None:
        if self.state != Residency.OFFLOADED:
            return None
        why = self._squeeze()
        if why is not None:
            if not self._refused_now:
                self.refusals += 1
                self._refused_now = True
                log.warning("draft reload refused: %s; retrying as sequences finish", why)
            self.last_refusal = why
            return why
        self._refused_now = False
        self.draft.kv.resize(self.base_blocks)
        self.draft.blocks.grow(self.base_blocks)
        self.mover.start_reload()
        self.state = Residency.RELOADING
        self._check()
        done = self.mover.poll()
        if done is not None:
            self._finish(done)
        return None

    def _squeeze(self) -> str | None:
        """Shrink the target pool to its base size, migrating live blocks; -> why not, or None."""
        n = self.base_blocks
        blocks = self.target.blocks
        sched = self.scheduler
        g = self.gamma_max
        # the next step after the reload reserves up to γmax lookahead slots per decoding sequence
        need = sum(blocks.blocks_for(s.num_tokens + (0 if s.is_prefill else g)) for s in sched.running)
        if need > n:
            return (f"running sequences need {need} KV blocks next step but the pool shrinks to {n} "
                    f"(from {blocks.num_blocks}); reloading now would preempt them")
        tables = [s.block_table for s in [*sched.running, *sched.waiting]]
        moves = blocks.plan_shrink(n, tables)
        if moves is None:
            return f"{blocks.num_used} live KV blocks do not fit in {n}"
        t0 = time.perf_counter()
        self.target.kv.resize(n, moves)
        blocks.apply_shrink(n, moves, tables)
        self.last_resize_ms = (time.perf_counter() - t0) * 1e3
        self.last_migrated_blocks = len(moves)
        return None

    # ------------------------------------------------------------------ completion

    def _finish(self, t: Transfer) -> None:
        if t.direction == "offload":
            assert self.state == Residency.OFFLOADING
            self.state = Residency.OFFLOADED
            self._grow_target()
            self.last_offload = t
            self.offloads += 1
        else:
            assert self.state == Residency.RELOADING
            self.state = Residency.RESIDENT
            self.last_reload = t
            self.reloads += 1
        self._check()
