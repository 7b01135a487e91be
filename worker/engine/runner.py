"""ModelRunner: one model with its paged KV pool and block manager, fed runs of tokens.

A ``Run`` is "these tokens of one sequence, starting at this position, written through this
block table; return logits for the last n of them". Target prefill chunks, target decode and
verify, draft catch-up and draft proposal steps are all lists of Runs, so there is one code
path from token lists to logits for both models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.kv_cache import KVCache, build_paged_batch
from worker.engine.model import LlamaModel


@dataclass
class Run:
    tokens: list[int]  # new tokens fed for this sequence
    start: int  # position of tokens[0] (= tokens already in this model's KV)
    table: list[int]  # the sequence's block table in this model's pool
    n_logits: int  # logits wanted for the last n_logits tokens (0 = none)
    prompt: bool = False  # a prefill chunk; prompt runs come after every other run


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, watermark: float) -> None:
        c = model.cfg
        self.model = model
        self.block_size = block_size
        self.kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, block_size, num_blocks, model.dtype, model.device)
        self.blocks = BlockManager(num_blocks, block_size, watermark)

    @staticmethod
    def bytes_per_block(model: LlamaModel, block_size: int) -> int:
        c = model.cfg
        return KVCache.bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, block_size, model.dtype)

    def forward(self, runs: list[Run]) -> torch.Tensor:
        """-> float32 logits [sum(n_logits), V] in run order."""
        dev = self.model.device
        flat: list[int] = []
        rows: list[int] = []
        prefill_from = None
        for r in runs:
            base = len(flat)
            if r.prompt and prefill_from is None:
                prefill_from = base
            elif prefill_from is not None and not r.prompt:
                raise ValueError("ModelRunner.forward: a decode run after a prompt run")
            flat.extend(r.tokens)
            rows.extend(range(base + len(r.tokens) - r.n_logits, base + len(r.tokens)))
        if not rows:  # a pure KV fill: still compute one row so the forward's shape is static
            rows = [len(flat) - 1]
        pb = build_paged_batch([r.start for r in runs], [len(r.tokens) for r in runs], [r.table for r in runs],
                               self.block_size, dev)
        ids = torch.tensor(flat, dtype=torch.long, device=dev)
        return self.model.forward(ids, pb, self.kv, torch.tensor(rows, dtype=torch.long, device=dev), prefill_from)
