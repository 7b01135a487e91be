"""How many draft tokens each sequence accepts: independent positions with P(accept i | i-1) = α_i.

The accepted length L ∈ {0..γ} of a sequence has P(L >= k) = Π_{i<k} α_i; sampling a batch is
one ``searchsorted`` of B uniforms into the CDF of L (no per-token Python).
"""

from __future__ import annotations

import numpy as np

DEFAULT_ALPHAS = (0.8, 0.76, 0.73, 0.7, 0.68, 0.66, 0.64, 0.62)


class AcceptanceProcess:
    def __init__(self, alphas: tuple[float, ...], gamma_max: int) -> None:
        if len(alphas) < gamma_max:
            alphas = tuple(alphas) + (alphas[-1] if alphas else 0.7,) * (gamma_max - len(alphas))
        if any(not 0.0 <= a <= 1.0 for a in alphas):
            raise ValueError(f"acceptance probabilities must be in [0, 1], got {alphas}")
        self.alphas = tuple(alphas[:gamma_max])
        survive = np.cumprod((1.0,) + self.alphas)  # survive[k] = P(L >= k)
        # cdf[γ][k] = P(L <= k) for k < γ; L = how many entries a uniform exceeds
        self.cdf = [1.0 - survive[1:g + 1] for g in range(gamma_max + 1)]
        self.expected = [float(survive[: g + 1].sum()) for g in range(gamma_max + 1)]  # E(γ) incl. bonus

    def sample(self, rng: np.random.Generator, batch: int, gamma: int) -> np.ndarray:
        """Accepted draft tokens per sequence, shape [batch], values in 0..gamma."""
        return np.searchsorted(self.cdf[gamma], rng.random(batch), side="right")
