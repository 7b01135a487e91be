"""Every record that crosses a process boundary, and its msgpack codec.

Records are frozen dataclasses encoded as a msgpack map of field name -> value. Decoding
never runs code (msgpack only, no pickle), refuses payloads over ``MAX_MESSAGE_BYTES``,
caps every container, and checks every field's type against the annotation, so a malformed
queue entry raises ``MessageError`` instead of travelling further.

Unknown fields are ignored (a newer writer may add fields); missing fields take their
default, and a missing field without a default is an error.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_args, get_origin, get_type_hints

import msgpack

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a 32k-token prompt is ~160 KB; 4 MiB leaves room, bounds abuse
MAX_CONTAINER_LEN = 1 << 20

T = TypeVar("T", bound="Message")


class MessageError(ValueError):
    """A payload that is not a valid record of the expected type."""


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = "message"

    def encode(self) -> bytes:
        # A shallow map: fields hold plain values (numbers, strings, bytes, tuples, maps) that
        # msgpack packs as they are, with the same bytes as dataclasses.asdict's deep copy at
        # 1/5 to 1/15 of the cost (it is on every request's and every token chunk's path).
        try:
            return msgpack.packb({name: getattr(self, name) for name in _names(type(self))}, use_bin_type=True)
        except TypeError:  # a nested record: asdict turns it into maps
            return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls: type[T], data: bytes | bytearray | memoryview) -> T:
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"{cls.__name__}: payload of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            obj = msgpack.unpackb(
                bytes(data),
                raw=False,
                strict_map_key=True,
                max_bin_len=MAX_MESSAGE_BYTES,
                max_str_len=MAX_MESSAGE_BYTES,
                max_array_len=MAX_CONTAINER_LEN,
                max_map_len=MAX_CONTAINER_LEN,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises several unrelated types
            raise MessageError(f"{cls.__name__}: not valid msgpack ({exc})") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        if not isinstance(obj, dict):
            raise MessageError(f"{cls.__name__}: expected a map, got {type(obj).__name__}")
        kwargs = {}
        for name, check, required in _schema(cls):
            if name in obj:
                kwargs[name] = check(obj[name])
            elif required:
                raise MessageError(f"{cls.__name__}: missing field {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"{cls.__name__}: {exc}") from None


_NAMES: dict[type, tuple[str, ...]] = {}
_SCHEMAS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    if cls not in _NAMES:
        _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return _NAMES[cls]


def _schema(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(field name, checker, required) per field, built once per class: an output chunk is
    decoded for every streamed token, and the generic per-field path (Optional fields recursing
    through the Union) was half its decode time (16 -> 7 µs per chunk)."""
    if cls not in _SCHEMAS:
        hints = get_type_hints(cls)
        _SCHEMAS[cls] = tuple(
            (f.name, _checker(hints[f.name], f"{cls.__name__}.{f.name}"),
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls))
    return _SCHEMAS[cls]


def _checker(tp: Any, where: str):
    """``_check`` for one field type, with the exact-type case answered without it."""
    exact = _EXACT.get(tp)
    if exact is None:
        return lambda value: _check(value, tp, where)
    plain, optional = exact

    def check(value: Any) -> Any:
        kind = type(value)
        if kind is plain or (optional and value is None):
            return value
        return _check(value, tp, where)

    return check


_PLAIN = (int, str, bytes, bool, float)
_INT_TUPLES = (tuple[int, ...],)
# Field types whose common value is of exactly one plain type (or None): (type, None allowed).
_EXACT: dict[Any, tuple[type, bool]] = {
    **{t: (t, False) for t in _PLAIN},
    **{t | None: (t, True) for t in _PLAIN},
}


def _check(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` (lists -> tuples) or raise MessageError."""
    # Fast paths first (token chunks are decoded for every streamed token): a value of
    # exactly the plain type, and a list of plain ints, need no typing introspection.
    if tp in _PLAIN and type(value) is tp:
        return value
    if tp in _INT_TUPLES and type(value) in (list, tuple) and all(type(v) is int for v in value):
        return tuple(value)
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in get_args(tp):
            if arm is type(None) and value is None:
                return None
            if arm is not type(None):
                try:
                    return _check(value, arm, where)
                except MessageError:
                    continue
        raise MessageError(f"{where}: {value!r:.80} is not {tp}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = get_args(tp)
        return tuple(_check(v, item_tp, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected a map, got {type(value).__name__}")
        ktp, vtp = get_args(tp)
        return {_check(k, ktp, where): _check(v, vtp, where) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bool, bytes):
        if not isinstance(value, tp):
            raise MessageError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    raise MessageError(f"{where}: unsupported field type {tp}")  # pragma: no cover - schema bug


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class SamplingParams(Message):
    """Validated by the gateway; the engine re-checks (it is also a public Python API)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed + same request = same output
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not returned
    ignore_eos: bool = False  # benchmarks force exact output lengths


@dataclass(frozen=True)
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
        return SamplingParams.from_dict(self.params)


# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Cancel(Message):
    request_id: str
    reason: str = "cancelled"


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
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
    memory_bytes: dict[str, int] = field(default_factory=dict)  # device budget by part (worker/engine/memory.py)
    # SIGTERM: finishing what it runs, taking nothing new; the scheduler and the gateways'
    # lease script send it no more work (it is still alive: its jobs are not re-dispatched).
    draining: bool = False
    # Engine steps taken so far: with requests running and this not moving, the worker is
    # stuck (a hung engine, a stopped engine process) however faithfully it heartbeats.
    engine_steps: int = 0


@dataclass(frozen=True)
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
    preempted: int = 0
    draft_residency: str = "none"
    acceptance_alarm: bool = False  # acceptance collapsed while it had been healthy
    memory_bytes: dict[str, int] = field(default_factory=dict)  # device budget by part (worker/engine/memory.py)


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
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
    residency: dict[str, str] = field(default_factory=dict)  # worker_id -> "resident"|"offloaded"
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


@dataclass(frozen=True)
class DeadLetter(Message):
    entry_id: str
    reason: str
    deliveries: int
    payload: bytes = b""  # the raw entry, truncated to 64 KiB
    unix_ms: int = 0
