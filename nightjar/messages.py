"""Every record that crosses a process boundary, and its one codec: msgspec Structs as msgpack.

Decoding never runs code, refuses payloads over ``MAX_MESSAGE_BYTES`` and checks every field's
type (typed decoders in C), so a malformed queue entry raises ``MessageError`` instead of
travelling further. Unknown fields are ignored (a newer writer may add fields); missing fields
take their default, and a missing field without a default is an error.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, TypeVar

import msgspec

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a 32k-token prompt is ~160 KB; 4 MiB leaves room, bounds abuse

T = TypeVar("T", bound="Message")


class MessageError(ValueError):
    """A payload that is not a valid record of the expected type."""


class Message(msgspec.Struct, frozen=True):
    KIND: ClassVar[str] = "message"

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls: type[T], data: bytes | bytearray | memoryview) -> T:
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"{cls.__name__}: payload of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return decode_any(cls, data, what=cls.__name__)

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise MessageError(f"{cls.__name__}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The record as plain values (maps, lists), as it goes on the wire."""
        return msgspec.to_builtins(self)

    def replace(self: T, **changes: Any) -> T:
        return msgspec.structs.replace(self, **changes)


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def _decoder(tp: Any) -> msgspec.msgpack.Decoder:
    """One typed decoder per record type (or union of tagged records), built on first use."""
    dec = _DECODERS.get(tp)
    if dec is None:
        dec = _DECODERS[tp] = msgspec.msgpack.Decoder(tp)
    return dec


def decode_any(tp: Any, data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES,
               what: str = "record") -> Any:
    """Decode ``data`` as ``tp`` (a record, or a union of tagged records), within ``max_bytes``."""
    if len(data) > max_bytes:
        raise MessageError(f"{what}: payload of {len(data)} bytes exceeds {max_bytes}")
    try:
        return _decoder(tp).decode(data)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        raise MessageError(f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"{what}: not valid msgpack ({exc})") from None


class Residency(str, enum.Enum):
    """Where the draft model's weights are (a str, so it compares and encodes as its value)."""

    RESIDENT = "resident"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    RELOADING = "reloading"
    NONE = "none"  # no draft model

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------- requests


class SamplingParams(Message):
    """Validated by the gateway; the engine re-checks (it is also a public Python API)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed + same request = same output
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not returned
    ignore_eos: bool = False  # benchmarks force exact output lengths


class Job(Message):
    """A queued request: gateway -> requests stream -> scheduler -> worker inbox."""

    KIND: ClassVar[str] = "job"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: dict[str, Any]  # SamplingParams as a map (nested records stay plain maps on the wire)
    deadline_unix_ms: int = 0  # the previous wire version: absolute, on the gateway's clock (0 = none)
    enqueued_unix_ms: int = 0
    attempt: int = 0  # how many times a worker has been given this job before
    # The deadline as the budget left (ms) when this copy was added to its stream; 0 = none.
    # The receiver counts it from the entry id (Redis' clock): nightjar/deadline.py.
    deadline_budget_ms: int = 0

    @property
    def sampling(self) -> SamplingParams:
        """The params as a record: kept a map on the wire so that a job with bad params still
        decodes, and the worker answers it with an error chunk instead of a dead letter."""
        return SamplingParams.from_dict(self.params)


# --------------------------------------------------------------------------- outputs


class OutputChunk(Message):
    """One entry of a request's output stream.

    ``index`` is the position in the completion of ``token_ids[0]``: a re-run of the request
    on another worker emits the same indices, so the gateway drops what it already sent.
    The last entry has ``finish_reason`` set ("stop", "length", "abort", "error", "deadline",
    "rejected": the engine refused the request's parameters, ``error`` says why).
    """

    KIND: ClassVar[str] = "out"
    request_id: str
    index: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    worker_id: str = ""


class Cancel(Message):
    request_id: str
    reason: str = "cancelled"


# --------------------------------------------------------------------------- workers


class Heartbeat(Message):
    """Published with a TTL; the scheduler picks the worker with the most free capacity."""

    worker_id: str
    unix_ms: int
    model: str
    kv_blocks_free: int
    kv_blocks_total: int
    running: int
    waiting: int
    max_running: int
    gamma: int
    draft_residency: str  # "resident" | "offloading" | "offloaded" | "reloading" | "none"
    policy_version: int = -1
    started_unix_ms: int = 0
    memory_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # device budget by part (worker/engine/budget.py)
    # SIGTERM: finishing what it runs, taking nothing new; the scheduler and the gateways'
    # lease script send it no more work (it is still alive: its jobs are not re-dispatched).
    draining: bool = False
    # Engine steps taken so far: with requests running and this not moving, the worker is
    # stuck (a hung engine, a stopped engine process) however faithfully it heartbeats.
    engine_steps: int = 0


class StepStats(Message):
    """What one engine step measured; the planner learns from these."""

    worker_id: str
    step: int
    unix_ms: int
    batch_size: int  # sequences decoded this step
    gamma: int
    draft_ms: float
    verify_ms: float
    step_ms: float
    accepted_per_position: tuple[int, ...] = ()  # [gamma] count of sequences accepting position i
    emitted_tokens: int = 0
    prefill_tokens: int = 0
    catchup_tokens: int = 0  # draft KV rebuilt after gamma went 0 -> >0 (switching cost)
    catchup_ms: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    waiting: int = 0
    max_running: int = 0  # the worker's cap on the batch (0: not said)
    preempted: int = 0
    preempted_tokens: int = 0  # target KV those preemptions freed, to be prefilled again (recompute)
    draft_residency: str = "none"
    acceptance_alarm: bool = False  # acceptance collapsed while it had been healthy
    memory_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # device budget by part (worker/engine/budget.py)


# --------------------------------------------------------------------------- policy


class Policy(Message):
    """γ per batch-size bucket plus draft residency per worker, published by the planner.

    ``bucket_upper_bounds[i]`` is the largest batch size of bucket i (ascending; the last
    bucket also covers anything larger). Workers ignore a policy older than ``ttl_s``.

    ``version`` grows within one ``epoch``: a random id the planner draws whenever it starts
    from a fresh state (nothing saved, or its saved state lost with a Redis that came back
    empty). Workers adopt a higher version of the epoch they hold or any epoch they have not
    left yet, so a planner that restarts from scratch at version 1 is not ignored until it
    climbs past the version the workers last saw.
    """

    version: int
    unix_ms: int
    ttl_s: float
    bucket_upper_bounds: tuple[int, ...]
    gamma_by_bucket: tuple[int, ...]
    residency: dict[str, str] = msgspec.field(default_factory=dict)  # worker_id -> "resident"|"offloaded"
    name: str = "nightjar"
    epoch: str = ""  # "" = a planner from before epochs (one epoch for all of them)

    def __post_init__(self) -> None:
        if len(self.bucket_upper_bounds) != len(self.gamma_by_bucket) or not self.gamma_by_bucket:
            raise ValueError("bucket_upper_bounds and gamma_by_bucket must be non-empty and equally long")
        if list(self.bucket_upper_bounds) != sorted(self.bucket_upper_bounds):
            raise ValueError("bucket_upper_bounds must ascend")

    def gamma_for(self, batch_size: int) -> int:
        for bound, gamma in zip(self.bucket_upper_bounds, self.gamma_by_bucket):
            if batch_size <= bound:
                return gamma
        return self.gamma_by_bucket[-1]


class DeadLetter(Message):
    entry_id: str
    reason: str
    deliveries: int
    payload: bytes = b""  # the raw entry, truncated to 64 KiB
    unix_ms: int = 0


class PolicyHold(Message):
    """A static policy for the planner to publish in place of its own while keys.planner_hold
    lives (it is set with an expiry, so a holder that dies releases it): an operator's pin, or an
    A/B window on one stack. The planner does not learn from the steps run under a hold, so its
    own policy resumes where it stood (planner_svc.service)."""

    policy: str  # a static planner_svc make_policy spec: off, fixed:G, threshold:B[:G], table:...
    reason: str = ""


class PlannerState(Message):
    """The planner's saved state (keys.planner_state): its policy's learned statistics, and the
    config they were learned under (resumed only by a planner with the same one)."""

    FORMAT: ClassVar[int] = 1
    MAX_BYTES: ClassVar[int] = 16 << 20  # a nightjar state is a few KB to a few hundred KB

    format: int
    version: int
    policy: str
    gamma_max: int
    buckets: tuple[int, ...]
    state: dict[Any, Any]  # GammaPolicy.state_dict()
    epoch: str = ""
    saved_unix_ms: int = 0

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PlannerState:
        saved = decode_any(cls, data, cls.MAX_BYTES, what="saved planner state unreadable")
        if saved.format != cls.FORMAT:
            raise MessageError(f"saved planner state is in format {saved.format}, not {cls.FORMAT}")
        return saved
