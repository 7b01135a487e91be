"""Sequence: one request's tokens and its single accounting model.

Everything the engine does is expressed with two counters per model:
  num_tokens   = prompt + completion tokens known so far
  num_computed = tokens whose target KV is in the cache (the last token is fed next step)
  draft_computed = the same for the draft's cache (lags while γ = 0; caught up on demand)
A prefill chunk, a decode step and a speculative verify are all "feed tokens[num_computed:]
(+ γ proposals) and sample where the run ends"; rollback is just setting counters back.
"""

from __future__ import annotations

import enum
import random

import torch

from nightjar.messages import SamplingParams
from nightjar.text import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: int,
                 max_total_tokens: int, detok: IncrementalDetokenizer | None) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt)
        self.num_prompt = len(prompt)
        self.arrival = arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self.draft_computed = 0
        self.block_table: list[int] = []
        self.draft_table: list[int] = []
        self.num_emitted = 0  # completion tokens already handed out in RequestOutputs
        self.finish_reason: str | None = None
        # the completion may not run past the model's context
        self.max_completion = min(params.max_tokens, max_total_tokens - len(prompt))
        self.detok = detok  # only when there are stop strings to look for
        self.greedy = params.temperature == 0.0
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def is_prefill(self) -> bool:
        """More than the last token is missing from the target's KV."""
        return self.num_computed < self.num_tokens - 1

    def reset_for_recompute(self) -> None:
        """Preempted: the KV is gone; prompt + completion so far are prefilled again later."""
        self.num_computed = 0
        self.draft_computed = 0
        self.status = Status.WAITING
