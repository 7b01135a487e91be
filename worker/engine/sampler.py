"""Per-row sampling: logits -> probabilities (temperature, top-k, top-p) and inverse-CDF draws.

Every row carries its own settings, so one batched call serves requests with different
parameters. Randomness comes in as uniforms drawn from each request's own torch.Generator
(``draw_uniforms``), so a seeded request samples the same tokens whatever else is batched
with it. Greedy rows become one-hot distributions, which makes the speculative acceptance
rule (rejection.py) reduce exactly to "accept while the draft matches the target's argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nightjar.messages import SamplingParams


def validate(params: SamplingParams, vocab_size: int) -> None:
    """The engine is a public API too: reject bad parameters with the field's name."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams.{field}: {why}")

    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise bad("max_tokens", f"must be an integer >= 1, got {params.max_tokens!r}")
    if not (params.temperature >= 0.0) or params.temperature != params.temperature or params.temperature > 100:
        raise bad("temperature", f"must be in [0, 100] (0 = greedy), got {params.temperature!r}")
    if not (0.0 < params.top_p <= 1.0):
        raise bad("top_p", f"must be in (0, 1], got {params.top_p!r}")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise bad("top_k", f"must be an integer >= 0 (0 = off), got {params.top_k!r}")
    if params.seed is not None and (not isinstance(params.seed, int) or not 0 <= params.seed < 2**63):
        raise bad("seed", f"must be an integer in [0, 2**63) or None, got {params.seed!r}")
    if any(not isinstance(s, str) or not s for s in params.stop) or len(params.stop) > 16:
        raise bad("stop", "must be at most 16 non-empty strings")


# A temperature below this samples greedily: logits / T overflows float32 for tiny T (1e-45 gave
# NaN probabilities and garbage tokens), and sampling's T -> 0 limit is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-6


@dataclass
class RowParams:
    """Sampling settings of R rows as tensors (built once per step)."""

    greedy: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R] float32 (1.0 on greedy rows, unused there)
    top_k: torch.Tensor  # [R] long (0 = off)
    top_p: torch.Tensor  # [R] float32
    all_greedy: bool
    any_filter: bool
    any_top_p: bool

    def to(self, device: torch.device) -> "RowParams":
        if device.type == "cpu":
            return self
        return RowParams(self.greedy.to(device), self.temperature.to(device), self.top_k.to(device),
                         self.top_p.to(device), self.all_greedy, self.any_filter, self.any_top_p)

    @classmethod
    def of(cls, params: list[SamplingParams], repeat: int = 1) -> "RowParams":
        """Each request's settings repeated ``repeat`` times (one row per verified position)."""
        greedy = [p.temperature < GREEDY_BELOW_TEMPERATURE for p in params for _ in range(repeat)]
        temp = [1.0 if g else p.temperature for p, g in zip((p for p in params for _ in range(repeat)), greedy)]
        top_k = [p.top_k for p in params for _ in range(repeat)]
        top_p = [p.top_p for p in params for _ in range(repeat)]
        return cls(
            greedy=torch.tensor(greedy), temperature=torch.tensor(temp, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.long), top_p=torch.tensor(top_p, dtype=torch.float32),
            all_greedy=all(greedy), any_filter=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            any_top_p=any(p < 1.0 for p in top_p),
        )


def probs_from_logits(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """logits: [R, V] float32 -> probs [R, V]; greedy rows are one-hot at the argmax."""
    if rp.all_greedy:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    x = logits / rp.temperature.unsqueeze(1)
    if rp.any_filter and not rp.any_top_p:  # top-k only: a partial top-k beats a full sort
        k = torch.where(rp.top_k > 0, rp.top_k, x.shape[1])  # [R]
        k_max = int(k.max())
        kth = x.topk(k_max, -1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1] k-th largest logit
        x = x.masked_fill(x < kth, float("-inf"))
    elif rp.any_filter:
        sorted_x, order = x.sort(-1, descending=True)  # [R, V]
        rank = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        k = torch.where(rp.top_k > 0, rp.top_k, x.shape[1]).unsqueeze(1)
        drop = rank >= k
        sp = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
        # top-p: drop a token when the mass before it already reaches top_p (the first is kept)
        drop |= (sp.cumsum(-1) - sp) >= rp.top_p.unsqueeze(1)
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    if rp.greedy.any():
        onehot = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(rp.greedy.unsqueeze(1), onehot, probs)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. probs: [R, V] (need not be normalised), u: [R] in [0, 1) -> [R] long.
    A zero-probability token is never returned (its CDF step is flat)."""
    cdf = probs.cumsum(-1)  # [R, V]
    x = (u * cdf[:, -1]).unsqueeze(1)  # [R, 1]
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)


def draw_uniforms(generators: list[torch.Generator | None], n: int) -> torch.Tensor:
    """[R, n] uniforms, row r from request r's own generator; None (a greedy row) gives zeros
    and consumes nothing."""
    out = torch.zeros(len(generators), n)
    if n:
        for i, g in enumerate(generators):
            if g is not None:
                out[i] = torch.rand(n, generator=g)  # CPU generators: device-independent
    return out
