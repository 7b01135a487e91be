"""What the SDK returns (plain frozen dataclasses) and the one place that builds requests.

Both clients (sync and asyncio) share ``build_request`` and ``Accumulator`` so that they
validate and assemble completions identically.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ._v1 import inference_pb2 as pb

from .errors import InvalidArgument

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Timings:
    """Measured by the gateway: from its receiving the request to the first token / the end."""

    ttft_ms: float = 0.0
    e2e_ms: float = 0.0


@dataclass(frozen=True)
class Delta:
    """One streamed increment. ``finish_reason``, ``usage`` and ``timings`` are set on the last only."""

    text: str
    token_ids: tuple[int, ...]
    request_id: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length"; None only if the stream ended without a final record
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    request_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_ids"] = list(self.token_ids)
        return d


@dataclass(frozen=True)
class ModelInfo:
    model: str
    draft_model: str
    max_context_tokens: int
    max_tokens_limit: int
    vocab_size: int
    gamma_max: int


def build_request(prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int | None = None, stop: list[str] | tuple[str, ...] | None = None,
                  ignore_eos: bool = False, request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest; only type/sign errors are caught here, ranges are the server's to judge."""
    if not isinstance(prompt, str):
        raise InvalidArgument(f"prompt must be a str, got {type(prompt).__name__}")
    if isinstance(stop, str):
        stop = [stop]  # a lone string would otherwise become a list of characters
    for name, value, limit in (("max_tokens", max_tokens or 0, 1 << 32), ("top_k", top_k, 1 << 32), ("seed", seed or 0, 1 << 64)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{name} must be a non-negative integer, got {value!r}")
        if value >= limit:  # the wire type's range; the server judges the real limits
            raise InvalidArgument(f"{name} must be below {limit}, got {value}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"{name} must be a number, got {value!r}")
    try:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens or 0, temperature=float(temperature),
                                 top_p=float(top_p), top_k=top_k, stop=list(stop or ()),
                                 ignore_eos=bool(ignore_eos), request_id=request_id)
        if seed is not None:
            req.seed = seed
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad request field: {exc}") from None
    return req


def delta_from(resp: pb.GenerateResponse) -> Delta:
    reason = FINISH_REASONS.get(resp.finish_reason)
    final = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return Delta(
        text=resp.text,
        token_ids=tuple(resp.token_ids),
        request_id=resp.request_id,
        finish_reason=reason,
        usage=Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens) if final else None,
        timings=Timings(resp.ttft_ms, resp.e2e_ms) if final else None,
    )


def model_info_from(resp: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(resp.model, resp.draft_model, resp.max_context_tokens, resp.max_tokens_limit,
                     resp.vocab_size, resp.gamma_max)


class Accumulator:
    """Folds deltas into a Completion."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._last: Delta | None = None
        self.request_id = ""

    def add(self, delta: Delta) -> None:
        self._text.append(delta.text)
        self._ids.extend(delta.token_ids)
        self.request_id = delta.request_id or self.request_id
        self._last = delta

    @property
    def started(self) -> bool:
        """True once anything a caller could have seen (text or tokens) arrived."""
        return bool(self._text and any(self._text)) or bool(self._ids)

    def completion(self) -> Completion:
        last = self._last
        return Completion(
            text="".join(self._text),
            token_ids=tuple(self._ids),
            finish_reason=last.finish_reason if last else None,
            usage=(last.usage if last and last.usage else Usage(0, len(self._ids))),
            timings=(last.timings if last and last.timings else Timings()),
            request_id=self.request_id,
        )
