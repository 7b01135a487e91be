"""The device budget: the parts it is split into, and how big each is.

    budget = target weights + draft weights (while on the device) + target KV pool + draft KV pool + workspace

The engine sizes its KV pools from it at start-up (``kv_pool_bytes``); the memory manager
(memory.py) measures the parts as ``MemoryParts`` and no transition leaves their sum above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.model import LlamaModel


def estimate_workspace_bytes(cfg: "EngineConfig", target: "LlamaModel") -> int:
    """Activation memory of the largest step: a rough upper bound, kept out of the KV pools.

    Per fed token: hidden states, q|k|v, gate|up and their products; per logit row: float32
    logits over the vocabulary (the verify step of a full batch); attention gathers K and V
    for every row of the batch at the longest context, one layer at a time.
    """
    c = target.cfg
    elem = target.w["norm"].element_size()
    per_token = (6 * c.hidden_size + 3 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * elem
    rows = cfg.max_running * (cfg.gamma_max + 1)
    ctx = min(cfg.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
    gather = 2 * cfg.max_running * ctx * c.num_kv_heads * c.head_dim * elem
    return cfg.max_batched_tokens * per_token + rows * c.vocab_size * 4 + gather


def kv_pool_bytes(cfg: "EngineConfig", target: "LlamaModel", draft: "LlamaModel | None") -> int:
    """Bytes for the KV pools (target + draft): ``kv_budget_bytes``, or, when a total
    ``memory_budget_bytes`` is set, what it leaves after the weights and the workspace."""
    budget = getattr(cfg, "memory_budget_bytes", None)
    if budget is None:
        return cfg.kv_budget_bytes
    weights = target.weight_bytes + (draft.weight_bytes if draft is not None else 0)
    workspace = workspace_of(cfg, target)
    left = budget - weights - workspace
    if left <= 0:
        raise ValueError(f"EngineConfig.memory_budget_bytes={budget} does not cover the weights ({weights} bytes) "
                         f"and the workspace ({workspace} bytes); raise it above {weights + workspace}")
    return left


def workspace_of(cfg: "EngineConfig", target: "LlamaModel") -> int:
    ws = getattr(cfg, "workspace_bytes", None)
    return estimate_workspace_bytes(cfg, target) if ws is None else ws


@dataclass(frozen=True)
class MemoryParts:
    """Device bytes per part; ``total`` never exceeds ``budget``."""

    budget: int
    target_weights: int
    draft_weights: int
    target_kv: int
    draft_kv: int
    workspace: int

    @property
    def total(self) -> int:
        return self.target_weights + self.draft_weights + self.target_kv + self.draft_kv + self.workspace

    @property
    def free(self) -> int:
        return self.budget - self.total

    def as_dict(self) -> dict[str, int]:
        return {"budget": self.budget, "target_weights": self.target_weights, "draft_weights": self.draft_weights,
                "target_kv": self.target_kv, "draft_kv": self.draft_kv, "workspace": self.workspace}
