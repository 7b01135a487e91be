"""Per-position draft acceptance, learned from ``StepStats.accepted_per_position``.

α_i = P(sequence accepts draft position i | it accepted positions 0..i-1). Each step gives, for
position i, trials_i = (sequences that accepted i-1, or the batch for i = 0) and successes_i =
accepted_per_position[i]. Counts decay by ``decay`` each time a position is observed, so the
estimate follows drift. Unobserved positions borrow strength from the previous one:

    α_i = (s_i + k·m_i) / (n_i + k),   m_0 = prior_mean,  m_i = α_{i-1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AcceptanceSettings:
    prior_mean: float = 0.6  # before any data: a typical draft/target pair
    prior_strength: float = 4.0  # pseudo-trials behind the prior
    decay: float = 0.995  # per observation of a position: ~200 steps of memory

    def __post_init__(self) -> None:
        if not 0.0 < self.prior_mean < 1.0:
            raise ValueError(f"prior_mean must be in (0, 1), got {self.prior_mean}")
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class AcceptanceEstimate:
    """The expected tokens a sequence emits in a step with γ drafts (the bonus token included) is

        E(γ) = 1 + Σ_{j=1..γ} Π_{i<j} α_i

    so observations at γ = 2 also predict the value of γ = 4 (one observation teaches every arm).
    """

    def __init__(self, gamma_max: int, settings: AcceptanceSettings = AcceptanceSettings()) -> None:
        self.gamma_max = gamma_max
        self.settings = settings
        self.successes = [0.0] * gamma_max
        self.trials = [0.0] * gamma_max
        self._expected: list[float] | None = None

    def observe(self, batch_size: int, gamma: int, accepted_per_position: tuple[int, ...]) -> None:
        gamma = min(gamma, len(accepted_per_position), self.gamma_max)
        decay = self.settings.decay
        successes, trials = self.successes, self.trials
        previous = batch_size
        for i in range(gamma):
            accepted = accepted_per_position[i]  # clipped to 0..previous
            if accepted < 0:
                accepted = 0
            elif accepted > previous:
                accepted = previous
            successes[i] = successes[i] * decay + accepted
            trials[i] = trials[i] * decay + previous
            previous = accepted
            if previous == 0:
                break  # later positions had no trials; leave their estimates alone
        self._expected = None

    def seed(self, alphas: list[float], trials: float = 64.0) -> None:
        """Start from offline per-position acceptance, worth ``trials`` sequences a position."""
        for i, a in enumerate(alphas[: self.gamma_max]):
            self.successes[i] = min(max(float(a), 0.0), 1.0) * trials
            self.trials[i] = trials
        self._expected = None

    def alphas(self) -> list[float]:
        out, mean = [], self.settings.prior_mean
        k = self.settings.prior_strength
        for s, n in zip(self.successes, self.trials):
            mean = (s + k * mean) / (n + k)
            out.append(mean)
        return out

    def expected_tokens(self) -> list[float]:
        """E(γ) for γ = 0..gamma_max."""
        if self._expected is None:
            self._expected = _expected(self.alphas())
        return self._expected

    def optimistic_tokens(self, z: float) -> list[float]:
        """E(γ) with each α_i raised by z standard errors of its (decayed) trials: what the arms
        may be worth while few sequences have been seen, as at batch 1 after an unlucky step."""
        k = self.settings.prior_strength
        raised = [min(0.99, a + z * (a * (1.0 - a) / (n + k)) ** 0.5) for a, n in zip(self.alphas(), self.trials)]
        return _expected(raised)

    def state_dict(self) -> dict[str, Any]:
        return {"successes": self.successes, "trials": self.trials}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("trials", ())) == self.gamma_max:
            self.successes = [float(x) for x in state["successes"]]
            self.trials = [float(x) for x in state["trials"]]
            self._expected = None


def _expected(alphas: list[float]) -> list[float]:
    out, survive = [1.0], 1.0
    for a in alphas:
        survive *= a
        out.append(out[-1] + survive)
    return out
