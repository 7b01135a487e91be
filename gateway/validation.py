"""Turn a GenerateRequest into SamplingParams, or say which field is wrong and what is allowed.

The bounds are the ones documented in proto/nightjar/v1/inference.proto; keep them in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.errors import InvalidArgument
from nightjar.messages import SamplingParams

MAX_STOP_STRINGS = 8
MAX_STOP_BYTES = 64
MAX_TOP_K = 1000
MAX_TEMPERATURE = 2.0
MAX_REQUEST_ID_CHARS = 64
MAX_SEED = 1 << 63  # SamplingParams (and torch generators) take seeds below 2**63
MAX_PROMPT_BYTES = 1 << 20  # tokenizing more than 1 MiB of text would stall the event loop


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    max_tokens_limit: int
    max_context_tokens: int


@dataclass(frozen=True)
class ValidRequest:
    prompt: str
    params: SamplingParams
    client_request_id: str  # "" when the caller chose none


def validate(req, limits: Limits) -> ValidRequest:
    """``req`` is a nightjar.v1.GenerateRequest (duck-typed so unit tests stay plain)."""
    if not req.prompt.strip():
        raise InvalidArgument("prompt", "must contain a non-whitespace character")
    if len(req.prompt.encode("utf-8", errors="surrogatepass")) > MAX_PROMPT_BYTES:
        raise InvalidArgument("prompt", f"must be at most {MAX_PROMPT_BYTES} bytes")
    max_tokens = req.max_tokens or limits.default_max_tokens
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidArgument("max_tokens", f"must be 1..{limits.max_tokens_limit} (0 = default {limits.default_max_tokens}), got {req.max_tokens}")
    temperature = float(req.temperature)
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE}], got {req.temperature}")
    top_p = float(req.top_p) or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1] (0 = default 1), got {req.top_p}")
    if req.top_k > MAX_TOP_K:
        raise InvalidArgument("top_k", f"must be 0 (off) to {MAX_TOP_K}, got {req.top_k}")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    for i, s in enumerate(req.stop):
        if not 1 <= len(s.encode("utf-8", errors="surrogatepass")) <= MAX_STOP_BYTES:
            raise InvalidArgument(f"stop[{i}]", f"must be 1 to {MAX_STOP_BYTES} bytes long")
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS or not all(0x21 <= ord(c) <= 0x7E for c in rid):
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces")
    seed = req.seed if req.HasField("seed") else None
    if seed is not None and seed >= MAX_SEED:  # the engine's generators take signed 64-bit seeds
        raise InvalidArgument("seed", f"must be 0 to {MAX_SEED - 1} (2**63 - 1), got {seed}")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=int(req.top_k),
        seed=seed, stop=tuple(req.stop), ignore_eos=bool(req.ignore_eos),
    )
    return ValidRequest(prompt=req.prompt, params=params, client_request_id=rid)


def check_length(prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    """After tokenizing: prompt plus completion must fit the model's context."""
    if prompt_tokens + max_tokens > limits.max_context_tokens:
        room = limits.max_context_tokens - max_tokens
        raise InvalidArgument(
            "prompt",
            f"is {prompt_tokens} tokens; with max_tokens={max_tokens} the model's context of "
            f"{limits.max_context_tokens} allows at most {max(room, 0)} prompt tokens (shorten the prompt or lower max_tokens)",
        )
