"""Every Redis key, stream, group and channel name Nightjar uses, in one place.

All names share the ``prefix`` (default ``nj``) so that several stacks can share one
Redis and a test can wipe exactly its own keys with ``SCAN MATCH {prefix}:*``.

A prefix that is a Redis Cluster hash tag, ``{nj}``, puts every key of the stack in one slot:
Cluster refuses a script, MULTI block or XREAD whose keys span slots, and Nightjar's span a
request, a worker and the queue at once (docs/reliability.md, "Redis Cluster").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HASH_TAG = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class Keys:
    prefix: str = "nj"

    def __post_init__(self) -> None:
        if ("{" in self.prefix or "}" in self.prefix) and not _HASH_TAG.fullmatch(self.prefix):
            raise ValueError(f"key prefix {self.prefix!r}: braces make a Redis Cluster hash tag, and then the whole "
                             "prefix must be one, like '{nj}'")

    @property
    def slot_tag(self) -> str | None:
        """The hash tag every key shares (one Cluster slot), or None when the prefix has none."""
        m = _HASH_TAG.fullmatch(self.prefix)
        return m.group(1) if m else None

    # --- request queue (gateway -> scheduler) ---------------------------------
    @property
    def requests(self) -> str:
        """Stream of queued jobs (messages.Job); consumer group ``scheduler_group``."""
        return f"{self.prefix}:requests"

    @property
    def scheduler_group(self) -> str:
        return "scheduler"

    @property
    def dead_letters(self) -> str:
        """Stream of jobs that failed too often or could not be decoded (messages.DeadLetter)."""
        return f"{self.prefix}:dlq"

    # --- dispatch (scheduler -> worker) ----------------------------------------
    def inbox(self, worker_id: str) -> str:
        """Stream of jobs assigned to one worker; consumer group ``worker_group``."""
        return f"{self.prefix}:inbox:{worker_id}"

    @property
    def worker_group(self) -> str:
        return "worker"

    @property
    def leases(self) -> str:
        """Hash worker -> "max_running kv_free kv_total" with a short TTL, written by the scheduler:
        the workers a gateway may put jobs into directly (nightjar.dispatch_lease)."""
        return f"{self.prefix}:leases"

    def assignment(self, request_id: str) -> str:
        """Hash: which worker runs a request, the job itself, and when it was assigned."""
        return f"{self.prefix}:assign:{request_id}"

    def worker_assignments(self, worker_id: str) -> str:
        """Set of request ids currently assigned to a worker (for re-dispatch on death)."""
        return f"{self.prefix}:worker_jobs:{worker_id}"

    # --- outputs (worker -> gateway) -------------------------------------------
    def output(self, request_id: str) -> str:
        """Stream of messages.OutputChunk for one request; expires after a TTL."""
        return f"{self.prefix}:out:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Key set (with TTL) when a request is cancelled; workers also get ``cancel_channel``."""
        return f"{self.prefix}:cancel:{request_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancels"

    @property
    def data_mark(self) -> str:
        """A random id set once (no TTL): a Redis that answers without it lost its data
        (restarted without persistence), and with it every output stream (gateway.output_reader)."""
        return f"{self.prefix}:data_mark"

    # --- workers ----------------------------------------------------------------
    def heartbeat(self, worker_id: str) -> str:
        """messages.Heartbeat with a TTL: a worker whose key expired is dead."""
        return f"{self.prefix}:hb:{worker_id}"

    @property
    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:hb:*"

    @property
    def workers(self) -> str:
        """Set of every worker id ever registered (live or dead; liveness = heartbeat key)."""
        return f"{self.prefix}:workers"

    # --- statistics and policy (worker <-> planner) -----------------------------
    @property
    def stats(self) -> str:
        """Capped stream of messages.StepStats; consumer group ``planner_group``."""
        return f"{self.prefix}:stats"

    @property
    def planner_group(self) -> str:
        return "planner"

    @property
    def policy(self) -> str:
        """Latest messages.Policy (plain key, versioned inside)."""
        return f"{self.prefix}:policy"

    @property
    def policy_channel(self) -> str:
        """Pub/sub channel on which every new messages.Policy is published."""
        return f"{self.prefix}:policy:updates"

    @property
    def planner_state(self) -> str:
        """The planner's saved state, so a restarted planner resumes."""
        return f"{self.prefix}:planner:state"

    @property
    def planner_hold(self) -> str:
        """messages.PolicyHold, set with an expiry: a static policy the planner publishes instead
        of its own while the key lives (``nightjar queue hold``; the one-stack bench)."""
        return f"{self.prefix}:planner:hold"

    @property
    def all_pattern(self) -> str:
        return f"{self.prefix}:*"
