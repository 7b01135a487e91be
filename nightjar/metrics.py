"""Prometheus metrics for every Nightjar service, named as vLLM users know them (``nightjar_``).

The families are defined here, unregistered; each service registers only its role's families
(``use``), so a scrape of the scheduler does not show a TTFT histogram nothing will ever fill.
Label values come only from fixed sets (finish reasons, move directions, draft positions,
residency states), so a misbehaving caller cannot blow up the series count. Units are in the
names (``_seconds``, ``_bytes``; ``_perc`` is a 0-1 fraction as in vLLM). docs/metrics.md lists
every name and the relabel rule that maps them onto vLLM's dashboards.
"""

from __future__ import annotations

import threading
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
                               start_http_server)

from nightjar.messages import Policy, Residency, StepStats

REGISTRY = CollectorRegistry(auto_describe=True)

FINISH_REASONS = ("stop", "length", "abort", "error", "deadline", "rejected", "other")
MOVE_DIRECTIONS = ("offload", "reload")
RESIDENCY_STATES = tuple(r.value for r in Residency)
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

_M = ("model_name",)  # vLLM's label: which served model a series belongs to

# --------------------------------------------------------------------------- engine state (worker)
# The endpoint answers before the models are loaded; compose's healthcheck waits for this instead
# (``nightjar health --http URL --ready-metric nightjar_worker_ready``).
WORKER_READY = Gauge("nightjar_worker_ready", "1 once the worker's models are loaded and it takes work, 0 before "
                     "and while it stops.")
REQUESTS_RUNNING = Gauge("nightjar_num_requests_running", "Sequences in the worker's running batch.", _M)
REQUESTS_WAITING = Gauge("nightjar_num_requests_waiting",
                         "Sequences the worker's engine holds but has not yet scheduled (vLLM's meaning).", _M)
KV_CACHE_USAGE = Gauge("nightjar_kv_cache_usage_perc", "Target KV-cache usage, 0 to 1 (1 = full).", _M)
PREEMPTIONS = Counter("nightjar_num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks.", _M)
PREEMPTED_TOKENS = Counter("nightjar_num_preempted_tokens",
                           "Target KV tokens freed by preemption, each prefilled again when its sequence returns.", _M)

# --------------------------------------------------------------------------- requests (gateway)
# Not vLLM's num_requests_waiting: admitted by the gateway (the --max-queued cap counts these)
# and not yet streaming a first token, wherever they are (tokenizing, in Redis, in a worker).
GATEWAY_QUEUED = Gauge("nightjar_gateway_requests_queued",
                       "Requests admitted by the gateway that have not yet received a first token.")
DISPATCH_PATHS = ("direct", "queued")
DISPATCHES = Counter("nightjar_dispatches", "Jobs the gateway put straight into a leased worker's inbox (direct) "
                     "or on the requests stream for the scheduler (queued).", ["path"])
REQUEST_SUCCESS = Counter("nightjar_request_success", "Finished requests by finish reason.",
                          _M + ("finished_reason",))
PROMPT_TOKENS = Counter("nightjar_prompt_tokens", "Prefill tokens of finished requests.", _M)
GENERATION_TOKENS = Counter("nightjar_generation_tokens", "Generated tokens of finished requests.", _M)
TTFT = Histogram("nightjar_time_to_first_token_seconds", "Time to first token.", _M, buckets=_TTFT_BUCKETS)
INTER_TOKEN = Histogram("nightjar_inter_token_latency_seconds", "Time between streamed tokens.", _M,
                        buckets=_ITL_BUCKETS)
E2E = Histogram("nightjar_e2e_request_latency_seconds", "End-to-end request latency.", _M, buckets=_E2E_BUCKETS)
QUEUE_TIME = Histogram("nightjar_request_queue_time_seconds", "Time from enqueue to the first scheduled step.", _M,
                       buckets=_E2E_BUCKETS)

# --------------------------------------------------------------------------- speculation (worker)
SPEC_DRAFTS = Counter("nightjar_spec_decode_num_drafts", "Sequence-steps that ran the draft (one per sequence).", _M)
SPEC_DRAFT_TOKENS = Counter("nightjar_spec_decode_num_draft_tokens", "Draft tokens proposed.", _M)
SPEC_ACCEPTED_TOKENS = Counter("nightjar_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", _M)
SPEC_ACCEPTED_PER_POS = Counter("nightjar_spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position (0 = first).", _M + ("position",))
GAMMA = Gauge("nightjar_gamma", "Speculation depth in force at the last step (0 = plain decoding).", _M)
DRAFT_RESIDENT = Gauge("nightjar_draft_resident", "1 when the draft's weights are on the device.", _M)
DRAFT_RESIDENCY = Gauge("nightjar_draft_residency", "1 for the draft residency state in force, 0 for the others.",
                        _M + ("state",))
ACCEPTANCE_ALARM = Gauge("nightjar_spec_decode_acceptance_alarm",
                         "1 while acceptance has collapsed after having been healthy (draft broken?).", _M)
CATCHUP = Histogram("nightjar_catchup_seconds", "Draft KV rebuild (switching cost) after gamma went 0 -> >0.", _M,
                    buckets=_SHORT_BUCKETS)
CATCHUP_TOKENS = Counter("nightjar_catchup_tokens", "Tokens re-prefilled into the draft's KV on catch-up.", _M)
STEP_TIME = Histogram("nightjar_step_seconds", "Engine step time (draft + verify + bookkeeping).", _M,
                      buckets=_SHORT_BUCKETS)

# --------------------------------------------------------------------------- elastic memory (worker)
DRAFT_MOVES = Counter("nightjar_draft_moves", "Draft offloads and reloads.", _M + ("direction",))
DRAFT_MOVE_SECONDS = Histogram("nightjar_draft_move_seconds", "Duration of a draft offload or reload.",
                               _M + ("direction",), buckets=_SHORT_BUCKETS)
DRAFT_MOVE_BYTES = Counter("nightjar_draft_move_bytes", "Bytes of draft weights moved.", _M + ("direction",))

# --------------------------------------------------------------------------- policy (planner, worker)
POLICY_VERSION = Gauge("nightjar_policy_version", "Version of the latest policy published (planner) or applied "
                       "(worker).")

ROLES: dict[str, tuple] = {
    "gateway": (GATEWAY_QUEUED, DISPATCHES, REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS, TTFT, INTER_TOKEN,
                E2E, QUEUE_TIME),
    "worker": (WORKER_READY, REQUESTS_RUNNING, REQUESTS_WAITING, KV_CACHE_USAGE, PREEMPTIONS, PREEMPTED_TOKENS,
               SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_ACCEPTED_PER_POS, GAMMA, DRAFT_RESIDENT,
               DRAFT_RESIDENCY, ACCEPTANCE_ALARM, CATCHUP, CATCHUP_TOKENS, STEP_TIME, DRAFT_MOVES, DRAFT_MOVE_SECONDS,
               DRAFT_MOVE_BYTES, POLICY_VERSION),
    "planner": (POLICY_VERSION,),
    "scheduler": (),  # its state is in Redis (`nightjar queue`); it exports process_* only
}

_use_lock = threading.Lock()
_registered: set[int] = set()  # id() of the collectors already in REGISTRY
_process = ProcessCollector(registry=None)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
_model_name = ""


def use(role: str, model_name: str = "") -> None:
    """Register ``role``'s families and the process collector in REGISTRY (idempotent).

    One ``REGISTRY`` per process, exposed by ``serve(port)`` at ``/metrics``; several roles in one
    process (tests) share it. ``model_name`` labels the request and engine series, as in vLLM, so
    one Prometheus can tell apart stacks serving different models; the first non-empty name a
    process gives is kept, since one process serves one model.
    """
    global _model_name
    if role not in ROLES:
        raise ValueError(f"metrics role must be one of {sorted(ROLES)}, got {role!r}")
    with _use_lock:
        if model_name and not _model_name:
            _model_name = model_name
        for collector in (_process, *ROLES[role]):
            if id(collector) not in _registered:
                REGISTRY.register(collector)
                _registered.add(id(collector))
        # Pre-create the fixed label sets so a scrape shows zeros instead of missing series.
        mn = _model_name
        if role == "gateway":
            for r in FINISH_REASONS:
                REQUEST_SUCCESS.labels(model_name=mn, finished_reason=r)
            for p in DISPATCH_PATHS:
                DISPATCHES.labels(path=p)
        if role == "worker":
            for d in MOVE_DIRECTIONS:
                DRAFT_MOVES.labels(model_name=mn, direction=d)
                DRAFT_MOVE_BYTES.labels(model_name=mn, direction=d)
                DRAFT_MOVE_SECONDS.labels(model_name=mn, direction=d)
            for st in RESIDENCY_STATES:
                DRAFT_RESIDENCY.labels(model_name=mn, state=st)


def model_name() -> str:
    """The ``model_name`` label value of this process's series ("" before ``use`` names one)."""
    return _model_name


_server_lock = threading.Lock()
_server_port: int | None = None


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Start the /metrics HTTP endpoint for this process on ``addr`` (``port`` 0 = off; idempotent
    per port). Loopback unless told: the services pass the gateway's interface, or what
    ``--metrics-host`` / NIGHTJAR_METRICS_HOST says (compose: every interface of the container).

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
    REQUEST_SUCCESS.labels(model_name=_model_name, finished_reason=_finish_label(finish_reason)).inc()
    PROMPT_TOKENS.labels(model_name=_model_name).inc(max(0, prompt_tokens))
    GENERATION_TOKENS.labels(model_name=_model_name).inc(max(0, completion_tokens))
    if ttft_s is not None:
        TTFT.labels(model_name=_model_name).observe(ttft_s)
    E2E.labels(model_name=_model_name).observe(e2e_s)
    if queue_s is not None:
        QUEUE_TIME.labels(model_name=_model_name).observe(queue_s)


def observe_inter_token(seconds: float) -> None:
    INTER_TOKEN.labels(model_name=_model_name).observe(seconds)


def _position_label(i: int) -> str:
    return str(i) if i < MAX_POSITION_LABELS else f"{MAX_POSITION_LABELS}+"


def observe_step(stats: StepStats) -> None:
    """Record one engine step (worker side). The running/waiting/KV gauges come from the
    engine's snapshot instead (``observe_engine_state``): they must also fall when it goes idle."""
    if stats.preempted:
        PREEMPTIONS.labels(model_name=_model_name).inc(stats.preempted)
        PREEMPTED_TOKENS.labels(model_name=_model_name).inc(stats.preempted_tokens)
    GAMMA.labels(model_name=_model_name).set(stats.gamma)
    if stats.gamma > 0 and stats.batch_size > 0:
        # vLLM counts one draft per sequence per step, and gamma tokens per draft.
        SPEC_DRAFTS.labels(model_name=_model_name).inc(stats.batch_size)
        SPEC_DRAFT_TOKENS.labels(model_name=_model_name).inc(stats.batch_size * stats.gamma)
    accepted = 0
    for i, count in enumerate(stats.accepted_per_position):
        if count:
            SPEC_ACCEPTED_PER_POS.labels(model_name=_model_name, position=_position_label(i)).inc(count)
            accepted += count
    if accepted:
        SPEC_ACCEPTED_TOKENS.labels(model_name=_model_name).inc(accepted)
    set_residency(stats.draft_residency)
    ACCEPTANCE_ALARM.labels(model_name=_model_name).set(1 if stats.acceptance_alarm else 0)
    if stats.catchup_tokens > 0:
        CATCHUP.labels(model_name=_model_name).observe(stats.catchup_ms / 1000.0)
        CATCHUP_TOKENS.labels(model_name=_model_name).inc(stats.catchup_tokens)
    if stats.step_ms > 0:
        STEP_TIME.labels(model_name=_model_name).observe(stats.step_ms / 1000.0)


def observe_engine_state(running: int, waiting: int, kv_blocks_free: int, kv_blocks_total: int) -> None:
    """Set the engine-state gauges from the worker's latest snapshot.

    A step's stats describe the batch it ran, which includes the sequences that finished in
    it; after the last one the engine is idle and takes no more steps, so without this the
    running gauge would keep the last batch's size for as long as the worker stays idle.
    """
    REQUESTS_RUNNING.labels(model_name=_model_name).set(running)
    REQUESTS_WAITING.labels(model_name=_model_name).set(waiting)
    if kv_blocks_total > 0:
        KV_CACHE_USAGE.labels(model_name=_model_name).set((kv_blocks_total - kv_blocks_free) / kv_blocks_total)


def set_residency(state: str) -> None:
    """Set the draft residency gauges ("resident", "offloading", "offloaded", "reloading", "none")."""
    if state not in RESIDENCY_STATES:
        raise ValueError(f"draft residency must be one of {RESIDENCY_STATES}, got {state!r}")
    DRAFT_RESIDENT.labels(model_name=_model_name).set(1 if state == Residency.RESIDENT else 0)
    for s in RESIDENCY_STATES:
        DRAFT_RESIDENCY.labels(model_name=_model_name, state=s).set(1 if s == state else 0)


def observe_draft_move(direction: str, seconds: float, nbytes: int) -> None:
    """Record one finished draft offload or reload (worker side)."""
    if direction not in MOVE_DIRECTIONS:
        raise ValueError(f"draft move direction must be one of {MOVE_DIRECTIONS}, got {direction!r}")
    DRAFT_MOVES.labels(model_name=_model_name, direction=direction).inc()
    DRAFT_MOVE_SECONDS.labels(model_name=_model_name, direction=direction).observe(seconds)
    DRAFT_MOVE_BYTES.labels(model_name=_model_name, direction=direction).inc(max(0, nbytes))


def observe_policy(policy: Policy) -> None:
    """Record the version of a policy published (planner) or applied (worker)."""
    POLICY_VERSION.set(policy.version)
