"""Turn a GenerateRequest into SamplingParams, or say which field is wrong and what is allowed.

The bounds are the ones documented in proto/nightjar/v1/inference.proto; keep them in step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.errors import InvalidArgument
from nightjar.messages import SamplingParams

MAX_STOP_STRINGS = 8
MAX_STOP_BYTES = 64
MAX_TOP_K = 1000
MAX_TEMPERATURE = 2.0
MAX_REQUEST_ID_CHARS = 64
MAX_SEED = 1 << 63  # SamplingParams (and torch generators) take seeds below 2**63
MAX_PROMPT_BYTES = 1 << 20  # the cap when none is derived from a model (unit tests)


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    max_tokens_limit: int
    max_context_tokens: int
    max_prompt_bytes: int = MAX_PROMPT_BYTES  # the gateway's: prompt_byte_cap(vocab, context)


def prompt_byte_cap(vocab: Mapping[str, int], context_tokens: int) -> int:
    """The longest prompt, in UTF-8 bytes, that could still fit the context.

    No token stands for more bytes than its vocabulary string takes in UTF-8 (byte-level BPE
    writes a byte as one or two characters; SentencePiece writes one as "<0xNN>" or a
    character of up to four bytes), so a prompt longer than context x longest token cannot
    fit, and is refused without tokenizing it. Text a normalizer deletes outright is the
    exception; such prompts are refused though they might fit.
    """
    longest = max((len(piece.encode("utf-8", errors="surrogatepass")) for piece in vocab), default=4)
    return context_tokens * max(longest, 4)


@dataclass(frozen=True)
class ValidRequest:
    prompt: str
    params: SamplingParams
    client_request_id: str  # "" when the caller chose none


@dataclass
class RequestFields:
    """The fields of a GenerateRequest, for front ends that do not speak protobuf (HTTP)."""

    prompt: str
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False
    request_id: str = ""

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's spelling, so validate() takes both
        return getattr(self, name) is not None


def validate(req, limits: Limits) -> ValidRequest:
    """``req`` is a nightjar.v1.GenerateRequest (duck-typed so unit tests stay plain)."""
    if not req.prompt.strip():
        raise InvalidArgument("prompt", "must contain a non-whitespace character")
    if len(req.prompt.encode("utf-8", errors="surrogatepass")) > limits.max_prompt_bytes:
        raise InvalidArgument("prompt", f"must be at most {limits.max_prompt_bytes} bytes "
                              f"(longer cannot fit the model's context of {limits.max_context_tokens} tokens)")
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
