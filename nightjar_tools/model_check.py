"""Checks `nightjar serve` runs before it starts anything, each failing with one line that says
what to change: the model types are ones the engine runs, target and draft share a tokenizer,
the pass-through limits fit, and the context the API advertises is the engine's real one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Mirrors worker.engine.config.EngineConfig and worker.engine.engine: keep in step (tests/nightjar_tools/test_serve_model.py
# checks the figure against a real engine's max_context_tokens).
ENGINE_KV_BUDGET_BYTES = 256 * 1024 * 1024
ENGINE_BLOCK_SIZE = 16
ENGINE_WATERMARK = 0.01
ENGINE_MAX_BATCHED_TOKENS = 512
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Served:
    context_tokens: int  # prompt + completion, what /v1/models and GetModelInfo advertise
    why: str  # which limit set it


def check(target: Path, draft: Path | None, *, dtype: str = "float32", max_model_len: int | None = None,
          max_num_seqs: int = 64, kv_cache_bytes: int | None = None, gamma_max: int = 6) -> Served:
    """The served context, or ValueError (one line) naming the flag or folder to change."""
    from worker.engine.loader import load_config  # validates model type, activation, rope scaling

    t = load_config(target)
    d = load_config(draft) if draft is not None else None
    if d is not None:
        _same_tokenizer(target, draft)
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if not 0 <= gamma_max <= 16:
        raise ValueError(f"--gamma-max must be 0..16, got {gamma_max}")
    if max_num_seqs * (gamma_max + 1) > ENGINE_MAX_BATCHED_TOKENS:
        raise ValueError(f"--max-num-seqs {max_num_seqs} x (--gamma-max {gamma_max} + 1) verify rows exceed the "
                         f"engine's {ENGINE_MAX_BATCHED_TOKENS} tokens per step; lower one of them")
    elem = DTYPE_BYTES[dtype]
    per_block = 2 * t.num_layers * t.num_kv_heads * t.head_dim * elem * ENGINE_BLOCK_SIZE
    if d is not None:  # both pools get the same block count
        per_block += 2 * d.num_layers * d.num_kv_heads * d.head_dim * elem * ENGINE_BLOCK_SIZE
    budget = kv_cache_bytes or ENGINE_KV_BUDGET_BYTES
    blocks = budget // per_block
    if blocks < 4:
        raise ValueError(f"--kv-cache-memory-bytes {budget} holds {blocks} KV blocks of {per_block} bytes; give at least {4 * per_block}")
    watermark = max(1, int(ENGINE_WATERMARK * blocks)) if blocks > 1 else 0
    limits = [(t.max_position_embeddings, f"{target.name} max_position_embeddings"),
              ((blocks - watermark) * ENGINE_BLOCK_SIZE - gamma_max - 1, f"KV cache of {budget} bytes")]
    if d is not None:
        limits.append((d.max_position_embeddings, f"draft {draft.name} max_position_embeddings"))
    real, why = min(limits)
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
        if max_model_len > real:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the engine's context of {real} tokens ({why})")
        return Served(max_model_len, "--max-model-len")
    return Served(real, why)


def _same_tokenizer(target: Path, draft: Path) -> None:
    a, b = _vocab(target), _vocab(draft)
    if b is None:
        return  # a draft folder without tokenizer files: the target's tokenizer serves both
    if a is None:
        raise ValueError(f"{target} has no tokenizer.json, so the draft's tokenizer cannot be checked against it")
    if a != b:
        raise ValueError(f"target {target.name} and draft {draft.name} do not share a tokenizer (tokenizer.json "
                         "vocabularies or special tokens differ); pick a draft trained with the target's tokenizer")


def _vocab(folder: Path) -> tuple | None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok.get("model", {}).get("vocab")
    added = sorted((t.get("id"), t.get("content")) for t in tok.get("added_tokens", []))
    return (json.dumps(vocab, sort_keys=True), tuple(added))
