"""Prometheus metrics for every Nightjar service, named as vLLM users know them (``nightjar_``).

One module-level ``REGISTRY`` per process: the gateway, scheduler, planner and worker record
into it through the functions below, and ``serve(port)`` exposes it at ``/metrics``. When
``nightjar serve`` runs several services in one process they share the endpoint, which is
what a single-host stack wants.

Label values come only from fixed sets (finish reasons, move directions, draft positions,
residency states), so a misbehaving caller cannot blow up the series count.

Units are in the names (``_seconds``, ``_bytes``, ``_perc`` is a 0-1 fraction as in vLLM).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

if TYPE_CHECKING:  # keep `import nightjar.metrics` free of the msgpack codec at import time
    from nightjar.messages import Policy, StepStats

REGISTRY = CollectorRegistry(auto_describe=True)

FINISH_REASONS = ("stop", "length", "abort", "error", "deadline", "rejected", "other")
MOVE_DIRECTIONS = ("offload", "reload")
RESIDENCY_STATES = ("resident", "offloading", "offloaded", "reloading", "none")
MAX_POSITION_LABELS = 16  # accepted-per-position series beyond this are summed into position "16+"

# Latency buckets: vLLM's, extended downwards because the CPU test models answer in milliseconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_SHORT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0)

# --------------------------------------------------------------------------- scheduler state
REQUESTS_RUNNING = Gauge("nightjar_num_requests_running", "Requests in model execution batches.",
                         registry=REGISTRY)
REQUESTS_WAITING = Gauge("nightjar_num_requests_waiting", "Requests queued, not yet running.",
                         registry=REGISTRY)
KV_CACHE_USAGE = Gauge("nightjar_kv_cache_usage_perc", "Target KV-cache usage, 0 to 1 (1 = full).",
                       registry=REGISTRY)
PREEMPTIONS = Counter("nightjar_num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks.",
                      registry=REGISTRY)

# --------------------------------------------------------------------------- requests (gateway)
DISPATCH_PATHS = ("direct", "queued")
DISPATCHES = Counter("nightjar_dispatches", "Jobs the gateway put straight into a leased worker's inbox (direct) "
                     "or on the requests stream for the scheduler (queued).", ["path"], registry=REGISTRY)
REQUEST_SUCCESS = Counter("nightjar_request_success", "Finished requests by finish reason.",
                          ["finished_reason"], registry=REGISTRY)
PROMPT_TOKENS = Counter("nightjar_prompt_tokens", "Prefill tokens of finished requests.", registry=REGISTRY)
GENERATION_TOKENS = Counter("nightjar_generation_tokens", "Generated tokens of finished requests.",
                            registry=REGISTRY)
TTFT = Histogram("nightjar_time_to_first_token_seconds", "Time to first token.",
                 buckets=_TTFT_BUCKETS, registry=REGISTRY)
INTER_TOKEN = Histogram("nightjar_inter_token_latency_seconds", "Time between streamed tokens.",
                        buckets=_ITL_BUCKETS, registry=REGISTRY)
E2E = Histogram("nightjar_e2e_request_latency_seconds", "End-to-end request latency.",
                buckets=_E2E_BUCKETS, registry=REGISTRY)
QUEUE_TIME = Histogram("nightjar_request_queue_time_seconds", "Time from enqueue to the first scheduled step.",
                       buckets=_E2E_BUCKETS, registry=REGISTRY)

# --------------------------------------------------------------------------- speculation (worker)
SPEC_DRAFTS = Counter("nightjar_spec_decode_num_drafts", "Sequence-steps that ran the draft (one per sequence).",
                      registry=REGISTRY)
SPEC_DRAFT_TOKENS = Counter("nightjar_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=REGISTRY)
SPEC_ACCEPTED_TOKENS = Counter("nightjar_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
                               registry=REGISTRY)
SPEC_ACCEPTED_PER_POS = Counter("nightjar_spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position (0 = first).",
                                ["position"], registry=REGISTRY)
GAMMA = Gauge("nightjar_gamma", "Speculation depth in force at the last step (0 = plain decoding).",
              registry=REGISTRY)
DRAFT_RESIDENT = Gauge("nightjar_draft_resident", "1 when the draft's weights are on the device.",
                       registry=REGISTRY)
DRAFT_RESIDENCY = Gauge("nightjar_draft_residency", "1 for the draft residency state in force, 0 for the others.",
                        ["state"], registry=REGISTRY)
ACCEPTANCE_ALARM = Gauge("nightjar_spec_decode_acceptance_alarm",
                         "1 while acceptance has collapsed after having been healthy (draft broken?).",
                         registry=REGISTRY)
CATCHUP = Histogram("nightjar_catchup_seconds", "Draft KV rebuild (switching cost) after gamma went 0 -> >0.",
                    buckets=_SHORT_BUCKETS, registry=REGISTRY)
CATCHUP_TOKENS = Counter("nightjar_catchup_tokens", "Tokens re-prefilled into the draft's KV on catch-up.",
                         registry=REGISTRY)
STEP_TIME = Histogram("nightjar_step_seconds", "Engine step time (draft + verify + bookkeeping).",
                      buckets=_SHORT_BUCKETS, registry=REGISTRY)

# --------------------------------------------------------------------------- elastic memory
DRAFT_MOVES = Counter("nightjar_draft_moves", "Draft offloads and reloads.", ["direction"], registry=REGISTRY)
DRAFT_MOVE_SECONDS = Histogram("nightjar_draft_move_seconds", "Duration of a draft offload or reload.",
                               ["direction"], buckets=_SHORT_BUCKETS, registry=REGISTRY)
DRAFT_MOVE_BYTES = Counter("nightjar_draft_move_bytes", "Bytes of draft weights moved.", ["direction"],
                           registry=REGISTRY)

# --------------------------------------------------------------------------- policy (planner)
POLICY_VERSION = Gauge("nightjar_policy_version", "Version of the latest policy published or applied.",
                       registry=REGISTRY)

# Pre-create the fixed label sets so a scrape shows zeros instead of missing series.
for _r in FINISH_REASONS:
    REQUEST_SUCCESS.labels(finished_reason=_r)
for _d in MOVE_DIRECTIONS:
    DRAFT_MOVES.labels(direction=_d)
    DRAFT_MOVE_BYTES.labels(direction=_d)
    DRAFT_MOVE_SECONDS.labels(direction=_d)
for _s in RESIDENCY_STATES:
    DRAFT_RESIDENCY.labels(state=_s)
for _p in DISPATCH_PATHS:
    DISPATCHES.labels(path=_p)

_server_lock = threading.Lock()
_server_port: int | None = None


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP endpoint for this process (``port`` 0 = off; idempotent per port).

    A second call with another port is refused: one process has one registry and one endpoint.
    """
    global _server_port
    if port == 0:
        return
    if not 0 < port < 65536:
        raise ValueError(f"metrics port must be 1-65535 (or 0 for off), got {port}")
    with _server_lock:
        if _server_port == port:
            return
        if _server_port is not None:
            raise RuntimeError(f"metrics already served on port {_server_port}; one endpoint per process")
        start_http_server(port, addr=addr, registry=REGISTRY)
        _server_port = port


def served_port() -> int | None:
    """The port ``serve`` bound in this process, None when metrics are not served."""
    return _server_port


def render() -> bytes:
    """The text exposition of this process's registry (what GET /metrics returns)."""
    return generate_latest(REGISTRY)


def sample(name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's current value (e.g. ``sample("nightjar_prompt_tokens_total")``), None if absent."""
    return REGISTRY.get_sample_value(name, labels or {})


def _finish_label(reason: str) -> str:
    return reason if reason in FINISH_REASONS else "other"


def observe_request_done(finish_reason: str, prompt_tokens: int, completion_tokens: int,
                         ttft_s: float | None, e2e_s: float, queue_s: float | None) -> None:
    """Record one finished request (gateway side); None for a time that was never reached."""
    REQUEST_SUCCESS.labels(finished_reason=_finish_label(finish_reason)).inc()
    PROMPT_TOKENS.inc(max(0, prompt_tokens))
    GENERATION_TOKENS.inc(max(0, completion_tokens))
    if ttft_s is not None:
        TTFT.observe(ttft_s)
    E2E.observe(e2e_s)
    if queue_s is not None:
        QUEUE_TIME.observe(queue_s)


def observe_inter_token(seconds: float) -> None:
    INTER_TOKEN.observe(seconds)


def _position_label(i: int) -> str:
    return str(i) if i < MAX_POSITION_LABELS else f"{MAX_POSITION_LABELS}+"


def observe_step(stats: StepStats) -> None:
    """Record one engine step (worker side)."""
    REQUESTS_RUNNING.set(stats.batch_size)
    REQUESTS_WAITING.set(stats.waiting)
    total_blocks = stats.kv_blocks_used + stats.kv_blocks_free
    if total_blocks > 0:
        KV_CACHE_USAGE.set(stats.kv_blocks_used / total_blocks)
    if stats.preempted:
        PREEMPTIONS.inc(stats.preempted)
    GAMMA.set(stats.gamma)
    if stats.gamma > 0 and stats.batch_size > 0:
        # vLLM counts one draft per sequence per step, and gamma tokens per draft.
        SPEC_DRAFTS.inc(stats.batch_size)
        SPEC_DRAFT_TOKENS.inc(stats.batch_size * stats.gamma)
    accepted = 0
    for i, count in enumerate(stats.accepted_per_position):
        if count:
            SPEC_ACCEPTED_PER_POS.labels(position=_position_label(i)).inc(count)
            accepted += count
    if accepted:
        SPEC_ACCEPTED_TOKENS.inc(accepted)
    set_residency(stats.draft_residency)
    ACCEPTANCE_ALARM.set(1 if stats.acceptance_alarm else 0)
    if stats.catchup_tokens > 0:
        CATCHUP.observe(stats.catchup_ms / 1000.0)
        CATCHUP_TOKENS.inc(stats.catchup_tokens)
    if stats.step_ms > 0:
        STEP_TIME.observe(stats.step_ms / 1000.0)


def set_residency(state: str) -> None:
    """Set the draft residency gauges ("resident", "offloading", "offloaded", "reloading", "none")."""
    if state not in RESIDENCY_STATES:
        raise ValueError(f"draft residency must be one of {RESIDENCY_STATES}, got {state!r}")
    DRAFT_RESIDENT.set(1 if state == "resident" else 0)
    for s in RESIDENCY_STATES:
        DRAFT_RESIDENCY.labels(state=s).set(1 if s == state else 0)


def observe_draft_move(direction: str, seconds: float, nbytes: int) -> None:
    """Record one finished draft offload or reload (worker side)."""
    if direction not in MOVE_DIRECTIONS:
        raise ValueError(f"draft move direction must be one of {MOVE_DIRECTIONS}, got {direction!r}")
    DRAFT_MOVES.labels(direction=direction).inc()
    DRAFT_MOVE_SECONDS.labels(direction=direction).observe(seconds)
    DRAFT_MOVE_BYTES.labels(direction=direction).inc(max(0, nbytes))


def observe_policy(policy: Policy) -> None:
    """Record the version of a policy published (planner) or applied (worker)."""
    POLICY_VERSION.set(policy.version)
