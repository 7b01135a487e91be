"""Proposer: the draft model's side of speculation — catch up its KV, then draft γ tokens.

The draft keeps its own paged KV (its own pool and block tables, same block size) and its own
counter ``seq.draft_computed``. While γ = 0 it does nothing at all, so its KV falls behind; the
first speculative step after that rebuilds the missing tokens with one batched draft prefill
(the catch-up, the switching cost C_switch), timed and counted. Which of the drafted tokens
the target keeps is decided in rejection.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from worker.engine.runner import ModelRunner, Run
from worker.engine.sampler import RowParams, probs_from_logits, sample
from worker.engine.sequence import Sequence


@dataclass
class Proposal:
    """The draft's γ tokens per sequence, handed to the target's verify pass and to rejection.py."""

    tokens: torch.Tensor  # [B, γ] draft tokens
    q: torch.Tensor | None  # [B, γ, V] draft probabilities (None when every row is greedy)
    draft_ms: float
    catchup_tokens: int
    catchup_ms: float


def table_policy(table: dict[int, int]) -> Callable[[int], int]:
    """A γ policy from a per-batch-size table, e.g. {1: 4, 4: 2, 16: 0}: the entry with the
    largest batch size <= the current one (the smallest entry covers anything below it).
    For Engine.set_gamma_policy until the planner's policy arrives."""
    if not table or any(g < 0 for g in table.values()):
        raise ValueError("table_policy: give a non-empty {batch_size: gamma >= 0} table")
    keys = sorted(table)

    def policy(batch_size: int) -> int:
        return table[max([k for k in keys if k <= batch_size], default=keys[0])]

    return policy


class Proposer:
    """The draft model, its KV pool, and its per-step work."""

    def __init__(self, runner: ModelRunner, target_vocab: int, max_catchup_tokens: int = 4096) -> None:
        self.runner = runner
        self.vocab = target_vocab
        self.max_catchup_tokens = max_catchup_tokens

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (pairs can differ in padded embedding rows)."""
        v = logits.shape[-1]
        if v == self.vocab:
            return logits
        if v > self.vocab:
            return logits[..., : self.vocab]
        pad = torch.full((*logits.shape[:-1], self.vocab - v), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], -1)

    def catch_up(self, seqs: list[Sequence]) -> int:
        """Feed the draft every token it missed except the last one or two (those the first
        proposal step feeds anyway); batched, in chunks of max_catchup_tokens. -> tokens fed."""
        runs: list[tuple[Sequence, Run]] = []
        for s in seqs:
            lag_end = s.num_tokens - 1
            if lag_end - s.draft_computed > 1:
                runs.append((s, Run(s.token_ids[s.draft_computed:lag_end], s.draft_computed, s.draft_table, 0)))
        total = 0
        while runs:
            chunk, size = [], 0
            while runs and (not chunk or size + len(runs[0][1].tokens) <= self.max_catchup_tokens):
                s, r = runs.pop(0)
                chunk.append((s, r))
                size += len(r.tokens)
            self.runner.forward([r for _, r in chunk])
            for s, r in chunk:
                s.draft_computed += len(r.tokens)
            total += size
        return total

    def propose(self, seqs: list[Sequence], gamma: int, rp: RowParams, u_draft: torch.Tensor) -> Proposal:
        """γ draft tokens per sequence. rp: one row per sequence; u_draft: [B, γ] uniforms."""
        t0 = time.perf_counter()
        caught = self.catch_up(seqs)
        t1 = time.perf_counter()
        # step 1 feeds what the draft still lacks: the last token, or the last two after a
        # fully accepted step (the bonus token's predecessor was never fed to the draft)
        runs = [Run(s.token_ids[s.draft_computed:], s.draft_computed, s.draft_table, 1) for s in seqs]
        toks, qs = [], []
        for j in range(gamma):
            logits = self._fit_vocab(self.runner.forward(runs))  # [B, V]
            if rp.all_greedy:
                x = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, rp)  # [B, V]
                x = sample(q, u_draft[:, j])
                qs.append(q)
            toks.append(x)
            if j + 1 < gamma:
                xl = x.tolist()
                runs = [Run([xl[i]], r.start + len(r.tokens), r.table, 1) for i, r in enumerate(runs)]
        for s in seqs:  # the draft now holds KV through position num_tokens - 1 + γ - 1
            s.draft_computed = s.num_tokens + gamma - 1
        t2 = time.perf_counter()
        return Proposal(
            tokens=torch.stack(toks, 1),
            q=torch.stack(qs, 1) if qs else None,
            draft_ms=(t2 - t1) * 1e3,
            catchup_tokens=caught,
            catchup_ms=(t1 - t0) * 1e3,
        )
