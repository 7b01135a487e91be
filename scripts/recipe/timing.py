"""Batch-1 single-token decode time of a transformers causal LM, with its KV cache."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel


@torch.inference_mode()
def decode_ms(models: dict[str, PreTrainedModel], prompt_len: int = 64, steps: int = 64, rounds: int = 5) -> dict[str, float]:
    """Median ms per decode forward for each model, measured interleaved round by round so that
    load from other processes on a shared machine hits every model alike."""
    samples: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            ids = torch.randint(1, model.config.vocab_size, (1, prompt_len))  # [1, prompt_len]
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)  # [1, 1]
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok, cache=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            samples[name].append((time.perf_counter() - t0) * 1000 / steps)
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
