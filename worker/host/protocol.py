"""What the worker service and an engine host say to each other, and the EngineHost protocol.

Commands go in, one StepResult comes out per step. Every record is a nightjar Message (one
msgspec codec), tagged so that a union of them decodes in one call: the subprocess host sends
exactly these records over its pipes.
"""

from __future__ import annotations

import threading
from typing import Protocol

import msgspec

from nightjar.messages import Message, Policy, SamplingParams, StepStats
from worker.engine.engine import RequestOutput


class Add(Message, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(Message, tag=True):
    request_id: str


class FollowPolicy(Message, tag=True):
    """γ and the draft's residency from the planner's policy from now on: the host keeps the
    worker's only PolicyView (worker/host/policy_view.py)."""

    worker_id: str
    default_gamma: int
    ttl_s: float | None


class UpdatePolicy(Message, tag=True):
    policy: Policy  # adopted by the host's view if newer than the one it holds


class SetResidency(Message, tag=True):
    # "resident" | "offloaded": a directive the engine's memory manager carries out now (tests,
    # scripts); under FollowPolicy the host's view gives its own whenever its answer changes
    residency: str


Command = Add | Abort | FollowPolicy | UpdatePolicy | SetResidency


class Snapshot(Message, tag=True):
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    gamma: int = 0
    draft_residency: str = "none"
    max_context_tokens: int = 0
    memory_bytes: tuple[tuple[str, int], ...] = ()  # (part, device bytes): MemoryParts, worker/engine/budget.py
    steps: int = 0  # engine steps taken: the heartbeat's proof of progress (a hung engine stops it)
    policy_version: int = -1  # the version of the policy the host's view holds (-1: none yet)


class StepResult(Message, tag=True):
    outputs: list[RequestOutput] = msgspec.field(default_factory=list)
    stats: StepStats | None = None
    rejected: list[tuple[str, str]] = msgspec.field(default_factory=list)  # (request_id, why add_request refused it)
    snapshot: Snapshot = msgspec.field(default_factory=Snapshot)


class EngineHost(Protocol):
    """Runs an engine off the event loop: EngineThread (in process) or EngineProcess (a child).

    ``ready`` is set once the engine is built (or failed: ``error``); ``snapshot`` is the first
    snapshot; later ones travel in the StepResults handed to the ``deliver`` callback.
    """

    ready: threading.Event
    error: BaseException | None
    snapshot: Snapshot

    def start(self) -> None: ...

    def submit(self, command: Command) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...
