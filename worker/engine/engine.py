"""Engine: continuous batching with optional draft speculation, one step at a time.

    step():  schedule() -> propose() (draft, only if γ > 0: proposer.py) -> verify() (target, γ+1
             positions) -> accept() (the acceptance rule: rejection.py) -> emit()

Single-threaded and not thread-safe: the worker service drives it from one thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nightjar.messages import Message, Residency, SamplingParams, StepStats
from nightjar.text import FastTokenizer, IncrementalDetokenizer
from worker.engine import rejection
from worker.engine.acceptance import AcceptanceMonitor
from worker.engine.budget import kv_pool_bytes
from worker.engine.config import EngineConfig
from worker.engine.linear import can_pack
from worker.engine.memory import MemoryManager
from worker.engine.model import LlamaModel
from worker.engine.proposer import Proposal, Proposer
from worker.engine.runner import ModelRunner, Run
from worker.engine.sampler import RowParams, draw_uniforms, probs_from_logits, sample, validate
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence

log = logging.getLogger("nightjar.engine")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestOutput(Message):
    request_id: str
    index: int  # position in the completion of new_token_ids[0]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        from transformers import AutoTokenizer

        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        dtype = cfg.torch_dtype
        # The target's weights never move, so on CPU they are packed once (worker/engine/linear.py);
        # the draft stays in plain tensors so the mover can offload it.
        target = LlamaModel.from_folder(cfg.target_path, dtype, cfg.device, packed=can_pack(torch.device(cfg.device), dtype),
                                        prefill_bf16=cfg.prefill_dtype == "bfloat16")
        draft = LlamaModel.from_folder(cfg.draft_path, dtype, cfg.device) if cfg.draft_path else None
        bpb = ModelRunner.bytes_per_block(target, cfg.block_size)
        if draft is not None:  # both pools get the same block count: the draft never runs out first
            bpb += ModelRunner.bytes_per_block(draft, cfg.block_size)
        num_blocks = kv_pool_bytes(cfg, target, draft) // bpb  # worker/engine/budget.py: kv_budget_bytes or what memory_budget_bytes leaves
        if num_blocks < 4:
            raise ValueError(f"EngineConfig.kv_budget_bytes={cfg.kv_budget_bytes} holds {num_blocks} blocks of "
                             f"{bpb} bytes; give at least {4 * bpb}")
        self.runner = ModelRunner(target, num_blocks, cfg.block_size, cfg.watermark)
        self.proposer = None
        if draft is not None:
            self.proposer = Proposer(ModelRunner(draft, num_blocks, cfg.block_size, 0.0), target.cfg.vocab_size)
        self.scheduler = Scheduler(self.runner.blocks, self.proposer.runner.blocks if self.proposer else None,
                                   cfg.max_running, cfg.max_batched_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.target_path)
        self._fast_tokenizer = FastTokenizer(self.tokenizer)  # stop-string detokenizers decode every step
        self.eos_ids = set(target.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        limits = [target.cfg.max_position_embeddings,
                  (num_blocks - self.runner.blocks.watermark_blocks) * cfg.block_size - cfg.gamma_max - 1]
        if draft is not None:
            limits.append(draft.cfg.max_position_embeddings)
        if cfg.max_model_len:
            limits.append(cfg.max_model_len)
        self.max_context_tokens = min(limits)
        self._policy: Callable[[int], int] = lambda batch_size: cfg.default_gamma
        self._pending: list[RequestOutput] = []
        self._arrivals = 0
        self._step_no = 0
        self.monitor = AcceptanceMonitor(cfg.acceptance_alarm_window, cfg.acceptance_alarm_floor,
                                         cfg.acceptance_alarm_healthy)
        self.last_stats: StepStats | None = None
        # device budget, draft offload/reload (worker/engine/memory.py); it owns the draft's residency
        self.memory = MemoryManager(cfg, self.runner, self.proposer.runner if self.proposer else None,
                                    self.scheduler, lambda: self.last_stats.waiting if self.last_stats else 0)

    # ------------------------------------------------------------------ public API

    def add_request(self, req: EngineRequest) -> None:
        ids = req.prompt_token_ids
        if not isinstance(req.request_id, str) or not req.request_id:
            raise ValueError("EngineRequest.request_id: must be a non-empty string")
        if self.scheduler.find(req.request_id) is not None:
            raise ValueError(f"EngineRequest.request_id: {req.request_id!r} is already in the engine")
        if not ids:
            raise ValueError("EngineRequest.prompt_token_ids: the prompt is empty; send at least one token")
        vocab = self.runner.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"EngineRequest.prompt_token_ids: every id must be an integer in [0, {vocab})")
        if len(ids) >= self.max_context_tokens:
            raise ValueError(f"EngineRequest.prompt_token_ids: prompt of {len(ids)} tokens leaves no room in the "
                             f"{self.max_context_tokens}-token context; shorten it")
        validate(req.params, vocab)
        detok = IncrementalDetokenizer(self._fast_tokenizer) if req.params.stop else None
        self._arrivals += 1
        self.scheduler.add(Sequence(req.request_id, list(ids), req.params, self._arrivals,
                                    self.max_context_tokens, detok))

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        self.scheduler.finish(seq)
        self._pending.append(RequestOutput(request_id, seq.num_emitted, [], True, "abort", seq.num_prompt,
                                           seq.num_emitted))

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._pending)

    def set_gamma_policy(self, fn: Callable[[int], int]) -> None:
        self._policy = fn

    def set_draft_residency(self, directive: str) -> None:
        """"resident" | "offloaded": the memory manager carries it out between steps (worker/engine/memory.py)."""
        self.memory.set_directive(directive)

    @property
    def draft_residency(self) -> str:
        """γ > 0 only while "resident" (the memory manager's state)."""
        return self.memory.state

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_blocks_free(self) -> int:
        return self.runner.blocks.num_free

    @property
    def kv_blocks_total(self) -> int:
        return self.runner.blocks.num_blocks

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.memory.poll()  # finish a draft transfer, pursue the residency directive
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule(self._gamma())
        if batch.empty:
            return outputs
        dev = self.runner.model.device
        rp = RowParams.of([s.params for s in batch.decode]).to(dev)
        gens = [None if s.greedy else s.generator for s in batch.decode]
        u = draw_uniforms(gens, 2 * batch.gamma + 1).to(dev)  # [Bd, 2γ+1]: draft, accept, final
        prop = self.proposer.propose(batch.decode, batch.gamma, rp, u) if batch.gamma else None
        t1 = time.perf_counter()
        logits = self._verify(batch, prop)
        new_tokens, accepted = self._accept(batch, prop, logits, rp, u)
        t2 = time.perf_counter()
        emitted = self._emit(new_tokens)
        self._record(batch, prop, accepted, sum(len(o.new_token_ids) for o in emitted), t0, t1, t2)
        return outputs + emitted

    def _gamma(self) -> int:
        if self.proposer is None or self.draft_residency != Residency.RESIDENT:
            return 0
        n = self.scheduler.num_decoding()
        return max(0, min(int(self._policy(n)) if n else 0, self.cfg.gamma_max))

    def _verify(self, batch: ScheduledBatch, prop: Proposal | None) -> torch.Tensor:
        """One target forward: decode rows [Bd * (γ+1)] first, then one row per finished prefill."""
        drafts = prop.tokens.tolist() if prop is not None else [[] for _ in batch.decode]
        runs = [Run(s.token_ids[s.num_computed:] + d, s.num_computed, s.block_table, batch.gamma + 1)
                for s, d in zip(batch.decode, drafts)]
        for s, chunk in batch.prefill:
            end = s.num_computed + chunk
            runs.append(Run(s.token_ids[s.num_computed:end], s.num_computed, s.block_table, int(end == s.num_tokens),
                            prompt=True))
        return self.runner.forward(runs)

    def _accept(self, batch: ScheduledBatch, prop: Proposal | None, logits: torch.Tensor, rp: RowParams,
                u: torch.Tensor) -> tuple[list[tuple[Sequence, list[int]]], torch.Tensor]:
        """-> (new tokens per sequence that sampled, accepted count per decode sequence [Bd])."""
        g, bd = batch.gamma, len(batch.decode)
        out: list[tuple[Sequence, list[int]]] = []
        dev = logits.device
        n = torch.zeros(bd, dtype=torch.long, device=dev)
        if bd:
            dl = logits[: bd * (g + 1)].view(bd, g + 1, -1)  # [Bd, γ+1, V]
            drafts = prop.tokens if prop is not None else torch.zeros(bd, 0, dtype=torch.long, device=dev)
            n, final = rejection.accept(dl, drafts, prop.q if prop is not None else None, rp,
                                        [s.params for s in batch.decode], u[:, g: 2 * g], u[:, 2 * g])
            n_l, f_l, d_l = n.tolist(), final.tolist(), drafts.tolist()
            for i, s in enumerate(batch.decode):
                old = s.num_tokens
                s.num_computed = old + n_l[i]  # KV of the last token and the accepted proposals
                if g:
                    s.draft_computed = min(old + g - 1, old + n_l[i])  # rollback: drop rejected draft KV
                out.append((s, d_l[i][: n_l[i]] + [f_l[i]]))
        ending = []
        for s, chunk in batch.prefill:
            s.num_computed += chunk
            if s.num_computed == s.num_tokens:
                ending.append(s)
        if ending:
            pl = logits[bd * (g + 1):]  # [E, V]
            erp = RowParams.of([s.params for s in ending]).to(dev)
            if erp.all_greedy:
                toks = pl.argmax(-1).tolist()
            else:
                u_end = draw_uniforms([s.generator for s in ending], 1)[:, 0].to(dev)
                toks = sample(probs_from_logits(pl, erp), u_end).tolist()
            out.extend((s, [t]) for s, t in zip(ending, toks))
        return out, n

    def _emit(self, new_tokens: list[tuple[Sequence, list[int]]]) -> list[RequestOutput]:
        """Append tokens one by one so a stop inside an accepted run cuts where plain decoding would."""
        outputs = []
        for s, toks in new_tokens:
            start = s.num_emitted
            for t in toks:
                if t in self.eos_ids and not s.params.ignore_eos:
                    s.finish_reason = "stop"
                    break
                s.token_ids.append(t)
                if s.detok is not None:
                    s.detok.push([t])
                    tail = s.detok.text[-(max(map(len, s.params.stop)) + 16):]
                    if any(stop in tail for stop in s.params.stop):
                        s.finish_reason = "stop"
                        break
                if s.num_completion >= s.max_completion:
                    s.finish_reason = "length"
                    break
            new = s.token_ids[s.num_prompt + start:]
            s.num_emitted = s.num_completion
            if s.finish_reason is not None:
                self.scheduler.finish(s)
            else:  # give back lookahead blocks the rejected proposals held
                self.runner.blocks.trim(s.block_table, s.num_tokens)
                if self.proposer is not None:
                    self.proposer.runner.blocks.trim(s.draft_table, s.num_tokens)
            if new or s.finish_reason is not None:
                outputs.append(RequestOutput(s.request_id, start, new, s.finish_reason is not None, s.finish_reason,
                                             s.num_prompt, s.num_completion))
        return outputs

    def _record(self, batch: ScheduledBatch, prop: Proposal | None, accepted: torch.Tensor,
                emitted: int, t0: float, t1: float, t2: float) -> None:
        self._step_no += 1
        g = batch.gamma
        per_pos = tuple(int((accepted > i).sum()) for i in range(g))
        alarm = self.monitor.observe(g, len(batch.decode), sum(per_pos))
        blocks = self.runner.blocks
        self.last_stats = StepStats(
            worker_id="", step=self._step_no, unix_ms=int(time.time() * 1000), batch_size=len(batch.decode),
            gamma=g, draft_ms=prop.draft_ms if prop else 0.0, verify_ms=(t2 - t1) * 1e3,
            step_ms=(time.perf_counter() - t0) * 1e3, accepted_per_position=per_pos,
            emitted_tokens=emitted,
            prefill_tokens=sum(c for _, c in batch.prefill),
            catchup_tokens=prop.catchup_tokens if prop else 0, catchup_ms=prop.catchup_ms if prop else 0.0,
            kv_blocks_used=blocks.num_used, kv_blocks_free=blocks.num_free, waiting=len(self.scheduler.waiting),
            max_running=self.cfg.max_running, preempted=batch.preempted, preempted_tokens=batch.preempted_tokens,
            draft_residency=self.draft_residency, acceptance_alarm=alarm,
            memory_bytes=self.memory.parts().as_dict(),
        )
