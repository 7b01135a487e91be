"""Workload: when each request arrives, how long its prompt is, how many tokens it asks for.

Arrival patterns and the Azure trace replay come from the planner's simulator
(``planner_svc.simulator.trace``), so the real-stack benchmark and the simulator mean the
same thing by "burst" or "azure_conv". That module expresses load as a multiple of a capacity;
here the capacity is the real stack's, measured by a short probe (``compare.calibrate``), and
the lengths are scaled down by ``LengthScale`` so that a run fits the slow CPU models and their
~1024-token context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nightjar import paths
from planner_svc.simulator import trace as sim_trace

CONTEXT_TOKENS = 1024  # the shipped models' max_position_embeddings
SPECS = ("poisson:RHO", "rates:RHO,RHO,...", "burst", "ramp", "oscillation", "azure_conv", "azure_code", "closed:C")
CLOSED_PROMPT_TOKENS = 32
CLOSED_OUTPUT_TOKENS = 64
CLOSED_WARMUP_S = 10.0  # the batch fills and the planner learns; steady state is what closed:C measures


@dataclass(frozen=True)
class LengthScale:
    """Multiplies the trace's lengths; the simulator's lengths (median 200 in / 100 out) would
    take minutes per request on a shared 2-core CPU."""

    prompt: float = 0.25  # on CPU a prompt token costs about what a decode step's token does; keep decode dominant
    output: float = 0.25
    min_prompt: int = 4
    min_output: int = 4
    max_output: int = 128

    def __post_init__(self) -> None:
        if not (0 < self.prompt <= 4 and 0 < self.output <= 4):
            raise ValueError(f"length scales must be in (0, 4], got prompt={self.prompt} output={self.output}")
        if not 1 <= self.min_output <= self.max_output:
            raise ValueError(f"need 1 <= min_output <= max_output, got {self.min_output}, {self.max_output}")
        if self.min_prompt < 1 or self.min_prompt + self.max_output >= CONTEXT_TOKENS:
            raise ValueError("min_prompt must be >= 1 and min_prompt + max_output below the context")

    def apply(self, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.clip(np.round(output * self.output), self.min_output, self.max_output).astype(np.int64)
        # Leave room for the completion inside the context (the gateway rejects longer).
        cap = CONTEXT_TOKENS - out - 8
        inp = np.clip(np.round(prompt * self.prompt), self.min_prompt, None).astype(np.int64)
        return np.minimum(inp, cap), out


@dataclass(frozen=True)
class Workload:
    """Specs: ``poisson:ρ`` (steady load ρ × capacity), ``rates:ρ1,ρ2,...`` (Poisson, equal-length
    steps at each load), ``burst``, ``ramp``, ``oscillation``, ``azure_conv``, ``azure_code``, and
    ``closed:C``: C clients in a closed loop, each sending its next fixed-length request (ignore_eos)
    as soon as the last one finished; the first ``CLOSED_WARMUP_S`` are not counted.
    """

    name: str
    arrival_s: np.ndarray  # [n] ascending, seconds from the run's start
    prompt_tokens: np.ndarray  # [n] int
    output_tokens: np.ndarray  # [n] int >= 1 (sent as max_tokens with ignore_eos)
    duration_s: float  # the arrival window; the run then drains
    capacity_rps: float  # the capacity the loads were scaled to
    nominal: tuple[tuple[float, float, float], ...] = ()  # (start s, end s, req/s) of the pattern's pieces
    clients: int = 0  # > 0: a closed loop of this many clients; arrival_s is then unused (all 0)
    warmup_s: float = 0.0  # requests sent before this are not counted (closed loops)
    cut: int = 0  # arrivals inside the window dropped by build's max_requests (the trace's tail)

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        assert len(self.prompt_tokens) == n == len(self.output_tokens)
        assert n == 0 or (np.all(np.diff(self.arrival_s) >= 0) and self.output_tokens.min() >= 1)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def nominal_rps(self, t: float) -> float | None:
        """The pattern's intended arrival rate at time t (None for a replayed trace)."""
        for start, end, rps in self.nominal:
            if start <= t < end:
                return rps
        return None

    def offered_rps(self, t0: float, t1: float) -> float:
        """Arrivals per second in [t0, t1)."""
        k = np.searchsorted(self.arrival_s, t1) - np.searchsorted(self.arrival_s, t0)
        return float(k) / max(t1 - t0, 1e-9)


def _mean_load(spec: str) -> float:
    if spec.startswith("rates:"):
        return float(np.mean(_rates(spec)))
    loads, weights = sim_trace.load_profile(spec)  # the simulator's shape table, shared on purpose
    return float(np.dot(loads, weights) / np.sum(weights))


def _rates(spec: str) -> list[float]:
    try:
        rates = [float(x) for x in spec.split(":", 1)[1].split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"workload {spec!r}: expected rates:ρ1,ρ2,... with loads such as 0.5") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"workload {spec!r}: loads must be > 0")
    return rates


def build(spec: str, capacity_rps: float, duration_s: float, *, seed: int = 0, scale: LengthScale = LengthScale(),
          max_requests: int = 2000, azure_load: float = 0.9) -> Workload:
    """A workload whose arrivals span ``duration_s`` at loads relative to ``capacity_rps``."""
    if not capacity_rps > 0:
        raise ValueError(f"capacity_rps must be > 0, got {capacity_rps}")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if spec.startswith("closed:"):
        return closed(spec, duration_s, capacity_rps)
    cap = lambda _prompt, _output: capacity_rps  # noqa: E731 - capacity was measured on the scaled mix
    nominal: tuple = ()
    if spec.startswith("azure_"):
        n = max(2, int(round(azure_load * capacity_rps * duration_s)))
        tr = sim_trace.azure(spec.split("_", 1)[1], cap, load=azure_load, requests=min(n, max_requests))
    elif spec.startswith("rates:"):
        rates = _rates(spec)
        rng = np.random.default_rng(seed)
        arrivals = sim_trace.piecewise_poisson(rng, [r * capacity_rps for r in rates], [duration_s / len(rates)] * len(rates))
        prompt, output = sim_trace.synthetic_lengths(rng, max(len(arrivals), 1))
        tr = sim_trace.Trace(spec, arrivals if len(arrivals) else np.zeros(1), prompt, output)
        nominal = _pieces(rates, [1.0] * len(rates), duration_s / len(rates), capacity_rps)
    else:
        n = max(1, int(round(_mean_load(spec) * capacity_rps * duration_s)))
        tr = sim_trace.make_trace(spec, cap, requests=n, seed=seed)
        loads, weights = sim_trace.load_profile(spec)
        # trace.synthetic stretches the pieces so that n requests are expected: the same unit here.
        unit_s = n / (capacity_rps * float(np.dot(loads, weights)))
        nominal = _pieces(list(loads), list(weights), unit_s, capacity_rps)
    arrival_s = np.asarray(tr.arrival_ms, dtype=float) / 1000.0
    keep = arrival_s < duration_s
    inside = int(keep.sum())
    keep[max_requests:] = False
    prompt, output = scale.apply(tr.prompt_tokens[keep], tr.output_tokens[keep])
    return Workload(spec, arrival_s[keep], prompt, output, duration_s, capacity_rps, nominal, cut=inside - int(keep.sum()))


def closed(spec: str, duration_s: float, capacity_rps: float = 1.0) -> Workload:
    """``closed:C``: C clients, ``duration_s`` of counted load after ``CLOSED_WARMUP_S`` of warm-up.
    Enough requests are planned for every client to send one every 0.1 s (a client stops at the
    end of the run, not when the plan runs out, unless the stack is faster than that)."""
    try:
        clients = int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"workload {spec!r}: expected closed:C with C clients, e.g. closed:16") from None
    if not 1 <= clients <= 1024:
        raise ValueError(f"workload {spec!r}: clients must be in 1..1024")
    total_s = CLOSED_WARMUP_S + duration_s
    n = min(100_000, clients * int(total_s * 10 + 1))
    return Workload(spec, np.zeros(n), np.full(n, CLOSED_PROMPT_TOKENS), np.full(n, CLOSED_OUTPUT_TOKENS),
                    total_s, capacity_rps, clients=clients, warmup_s=CLOSED_WARMUP_S)


def _pieces(loads: list[float], weights: list[float], unit_s: float, capacity_rps: float) -> tuple:
    out, start = [], 0.0
    for load, w in zip(loads, weights):
        out.append((start, start + w * unit_s, float(load) * capacity_rps))
        start += w * unit_s
    return tuple(out)


class PromptBank:
    """Prompt texts of a requested token length, cut from the shipped held-out prompt set.

    All prompts are joined into one token pool; a request of n tokens gets a window of n
    tokens at a seeded offset, decoded back to text (re-tokenizing may differ by a token or
    two at the cut; the gateway's count is what the report uses).
    """

    def __init__(self, prompts_path: Path = paths.HELDOUT_PROMPTS, tokenizer_path: Path = paths.DEFAULT_TARGET / "tokenizer.json"):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_path))
        texts = []
        with open(prompts_path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    texts.append(json.loads(line)["text"])
        if not texts:
            raise ValueError(f"{prompts_path} holds no prompts; expected one {{\"id\", \"text\"}} per line")
        self._pool = self._tok.encode("\n\n".join(texts)).ids
        if len(self._pool) < CONTEXT_TOKENS:
            raise ValueError(f"{prompts_path}: only {len(self._pool)} tokens in all, need at least {CONTEXT_TOKENS}")

    def text(self, n_tokens: int, rng: np.random.Generator) -> str:
        n = max(1, min(int(n_tokens), len(self._pool) - 1))
        start = int(rng.integers(0, len(self._pool) - n))
        text = self._tok.decode(self._pool[start:start + n])
        # The gateway refuses a prompt without a non-whitespace character.
        return text if text.strip() else "x" + text

    def token_count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)

    def texts(self, workload: Workload, seed: int = 0) -> list[str]:
        rng = np.random.default_rng(seed + 7919)  # independent of the arrival stream's draws
        return [self.text(int(n), rng) for n in workload.prompt_tokens]
