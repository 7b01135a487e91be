"""Security: bearer auth (constant-time), no code-running decoders anywhere, Redis password and
TLS options passed through by every service, and a fuzz of request validation (hypothesis:
thousands of generated requests against an independent statement of the documented rules, plus
a few hundred through the real gRPC server)."""

from __future__ import annotations

import inspect
import math
import os
import re
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import interceptors
from gateway.errors import InvalidArgument
from gateway.validation import (
    MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_CHARS,
    MAX_SEED,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    Limits,
    validate,
)
from nightjar import paths
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from tests.stack.conftest import REDIS_PASSWORD, TOKEN, command_lines_under, dead_services, hardened_stack, metadata
from worker.engine import sampler

ROOT = paths.ROOT
LIMITS = Limits(default_max_tokens=64, max_tokens_limit=1024, max_context_tokens=1024)


# --------------------------------------------------------------------------- auth


def test_auth_compare_is_constant_time():
    source = Path(interceptors.__file__).read_text()
    assert "hmac.compare_digest(" in source
    # No early-exit comparison of the token anywhere in the gateway.
    for path in (ROOT / "gateway").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"(==|!=|startswith\(|in )\s*self\._expected|_expected\s*(==|!=)", text), path


def test_auth_on_guards_inference_but_not_probes():
    stack = hardened_stack()
    with grpc.insecure_channel(stack.address) as channel:
        # Health and reflection stay open: orchestrators probe without secrets.
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.InferenceServiceStub(channel)
        for md in ((), (("authorization", "Bearer x"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (info.value.details() or "")  # never echo the secret
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata(), timeout=10).max_tokens_limit > 0


# --------------------------------------------------------------------------- no code-running decoders

FORBIDDEN = [
    (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|marshal|shelve)\b", re.M), "pickle-family import"),
    (re.compile(r"\b(c?pickle|dill|marshal)\.loads?\("), "pickle-family load"),
    (re.compile(r"(?<![\w.])eval\("), "builtin eval("),
    (re.compile(r"(?<![\w.])exec\("), "builtin exec("),
    (re.compile(r"(?<![\w.])__import__\("), "__import__("),
    (re.compile(r"yaml\.(unsafe_)?load\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"weights_only\s*=\s*False"), "torch.load(weights_only=False)"),
]


def test_no_pickle_eval_or_exec_outside_tests():
    sources = [p for p in ROOT.rglob("*.py") if not {".venv", "tests", "node_modules", ".git", "runs"} & set(p.relative_to(ROOT).parts)]  # runs/: git-ignored local output
    assert len(sources) > 50, "the scan must see the project's sources"
    hits = []
    for path in sources:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in FORBIDDEN:
                if pattern.search(code):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_scan_would_catch_them():
    bad = ["import pickle", "x = pickle.loads(b)", "eval(s)", "y = exec(code)", "__import__('os')", "from dill import x"]
    assert all(any(p.search(line) for p, _ in FORBIDDEN) for line in bad)
    fine = ["model.eval()", "pipe.eval(SCRIPT, 1, k)", "ast.literal_eval(s)", "r.execute()"]
    assert not any(p.search(line) for line in fine for p, _ in FORBIDDEN)


# --------------------------------------------------------------------------- Redis password and TLS

TLS_URL = f"rediss://:{REDIS_PASSWORD}@redis.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"


def _configs(url: str) -> dict:
    from gateway.__main__ import parse_config as gateway
    from planner_svc.__main__ import parse_config as planner
    from scheduler_svc.__main__ import parse_config as scheduler
    from worker.__main__ import parse_config as worker

    return {name: parse(["--redis-url", url]) for name, parse in
            (("gateway", gateway), ("scheduler", scheduler), ("planner", planner), ("worker", worker))}


def test_every_service_config_takes_password_and_tls_options():
    from nightjar.service_util import connect_redis

    for name, cfg in _configs(TLS_URL).items():
        assert cfg.redis_url == TLS_URL, name
        client = connect_redis(cfg.redis_url)
        kw = client.connection_pool.connection_kwargs
        assert client.connection_pool.connection_class.__name__ == "SSLConnection", name
        assert kw["password"] == REDIS_PASSWORD and kw["ssl_ca_certs"] == "/etc/ca.pem", name
        assert kw["ssl_cert_reqs"] == "required", name
    with pytest.raises(SystemExit):  # a plain host:port is refused with a message, not misread
        _configs("redis.example:6379")


def test_queue_tool_takes_password_and_tls_options():
    from nightjar_tools.queue_tool.cli import connect

    r = connect("redis://redis.example:6380/0", password=REDIS_PASSWORD, tls=True, tls_ca="/etc/ca.pem")
    kw = r.connection_pool.connection_kwargs
    assert r.connection_pool.connection_class.__name__ == "SSLConnection"
    assert kw["password"] == REDIS_PASSWORD and kw["ssl_ca_certs"] == "/etc/ca.pem"


def test_the_stack_runs_against_a_password_protected_redis():
    """Every service of the hardened stack got the password through its --redis-url (the stack
    serves), and Redis refuses a client without it."""
    stack = hardened_stack()
    anonymous = redis.Redis.from_url(stack.redis_url.replace(f":{REDIS_PASSWORD}@", ""), socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    assert {s.name for s in stack.services} >= {"gateway", "scheduler", "planner", "worker"}
    assert not dead_services(stack)
    assert all(REDIS_PASSWORD in s.env["NIGHTJAR_REDIS_URL"] for s in stack.services)


def test_no_secret_on_any_child_command_line():
    """The Redis password and the bearer token reach every child (services, their own children,
    redis-server) through the environment or a file: never argv, which any local user reads in
    /proc/PID/cmdline and `ps`."""
    stack = hardened_stack()
    lines = command_lines_under(os.getpid())
    assert {s.proc.pid for s in stack.services} <= set(lines), "the walk must see every service"
    assert any("redis-server" in line for line in lines.values()), "and the password-protected redis-server"
    leaks = {pid: line for pid, line in lines.items() if TOKEN in line or REDIS_PASSWORD in line}
    assert not leaks, leaks


def test_metrics_bind_where_the_gateway_binds(monkeypatch, tmp_path):
    """/metrics follows the gateway's interface (loopback stays loopback); the other services
    bind loopback unless told (compose tells them: the container's network)."""
    from gateway.__main__ import parse_config as gateway
    from nightjar import metrics
    from nightjar_tools.stack import Stack, StackConfig

    monkeypatch.delenv("NIGHTJAR_METRICS_HOST", raising=False)
    assert gateway([]).metrics_host == "127.0.0.1"
    assert gateway(["--host", "0.0.0.0"]).metrics_host == "0.0.0.0"
    assert gateway(["--host", "127.0.0.1", "--metrics-host", "10.0.0.5"]).metrics_host == "10.0.0.5"
    for name, cfg in _configs("redis://h:1/0").items():
        assert cfg.metrics_host == "127.0.0.1", name
    monkeypatch.setenv("NIGHTJAR_METRICS_HOST", "0.0.0.0")
    assert all(cfg.metrics_host == "0.0.0.0" for cfg in _configs("redis://h:1/0").values())
    assert inspect.signature(metrics.serve).parameters["addr"].default == "127.0.0.1"
    # nightjar serve: every service's /metrics on the gateway's --host
    stack = Stack(StackConfig(host="127.0.0.1", metrics_port=9400, redis_url="redis://h:1/0", log_dir=tmp_path))
    spawned = []
    monkeypatch.setattr("subprocess.Popen", lambda argv, **kw: spawned.append(argv))
    stack.redis_url = "redis://h:1/0"
    for name in ("scheduler", "worker", "gateway"):
        stack._spawn(name, [])
    assert all(argv[argv.index("--metrics-host") + 1] == "127.0.0.1" for argv in spawned)


def test_a_redis_password_never_reaches_redis_server_argv():
    from nightjar_tools.redis_server import EmbeddedRedis

    with EmbeddedRedis(password="pw-only-in-a-file") as server:
        assert "pw-only-in-a-file" not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, socket_timeout=5).ping()
        assert redis.Redis.from_url(server.url, socket_timeout=5).ping()


# --------------------------------------------------------------------------- fuzz


def expected_problem(req: pb.GenerateRequest) -> str | None:
    """The documented rules (inference.proto), written independently of gateway.validation:
    None when the request is valid, else the field the first broken rule names."""
    if not req.prompt.strip():
        return "prompt"
    if len(req.prompt.encode()) > MAX_PROMPT_BYTES:
        return "prompt"
    max_tokens = req.max_tokens or LIMITS.default_max_tokens
    if not 1 <= max_tokens <= LIMITS.max_tokens_limit:
        return "max_tokens"
    if math.isnan(req.temperature) or not 0 <= req.temperature <= MAX_TEMPERATURE:
        return "temperature"
    top_p = req.top_p or 1.0
    if math.isnan(top_p) or not 0 < top_p <= 1:
        return "top_p"
    if req.top_k > MAX_TOP_K:
        return "top_k"
    if len(req.stop) > MAX_STOP_STRINGS:
        return "stop"
    for i, s in enumerate(req.stop):
        if not 1 <= len(s.encode()) <= MAX_STOP_BYTES:
            return f"stop[{i}]"
    if len(req.request_id) > MAX_REQUEST_ID_CHARS or any(not 33 <= ord(c) <= 126 for c in req.request_id):
        return "request_id"
    if req.HasField("seed") and req.seed >= MAX_SEED:
        return "seed"
    return None


f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
edgy_text = st.sampled_from(["", " ", "\t\n", "\u200b", "\u3000", "ok", "€", "\U0001f600", "a" * 65, "\x00"])
requests = st.builds(
    lambda prompt, max_tokens, temperature, top_p, top_k, seed, stop, eos, rid: _request(
        prompt, max_tokens, temperature, top_p, top_k, seed, stop, eos, rid),
    prompt=st.one_of(edgy_text, st.text(max_size=120)),
    max_tokens=st.one_of(st.sampled_from([0, 1, 1024, 1025, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    temperature=st.one_of(st.sampled_from([0.0, 2.0, -0.0, 1e-45]), f32),
    top_p=st.one_of(st.sampled_from([0.0, 1.0, 1e-7, 1.0000001]), f32),
    top_k=st.one_of(st.sampled_from([0, 1000, 1001]), st.integers(0, 2**32 - 1)),
    seed=st.one_of(st.none(), st.sampled_from([0, MAX_SEED - 1, MAX_SEED, 2**64 - 1]), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.one_of(edgy_text, st.text(max_size=70)), max_size=11),
    eos=st.booleans(),
    rid=st.one_of(st.just(""), edgy_text, st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=200), max_size=70)),
)


def _request(prompt, max_tokens, temperature, top_p, top_k, seed, stop, eos, rid) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, stop=stop, ignore_eos=eos, request_id=rid)
    if seed is not None:
        req.seed = seed
    return req


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_fuzz_validation_matches_the_documented_rules(req):
    want = expected_problem(req)
    try:
        valid = validate(req, LIMITS)
    except InvalidArgument as exc:
        assert want is not None, f"valid request refused: {exc}"
        assert exc.field == want and str(exc).startswith(f"{want}: "), f"expected {want}, got {exc}"
        return
    assert want is None, f"request with a bad {want} was accepted"
    # Whatever the gateway accepts, the engine accepts too (no late "rejected" at a worker).
    sampler.validate(valid.params, vocab_size=32000)
    assert 1 <= valid.params.max_tokens <= LIMITS.max_tokens_limit


@pytest.mark.slow
def test_fuzz_through_the_real_grpc_server():
    """A few hundred generated requests through the real gateway: only OK or INVALID_ARGUMENT
    naming the documented field (plus the prompt-length rule, which needs the tokenizer), and
    the stack still serves afterwards."""
    stack = hardened_stack()
    seen: dict[str, int] = {}
    with grpc.insecure_channel(stack.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)  # the same 300 every run: CI stays reproducible
        @given(requests)
        def one(req):
            want = expected_problem(req)
            call = stub.Generate(req, metadata=metadata(), timeout=60)
            try:
                first = next(call, None)
                call.cancel()  # one response is enough: valid requests are not run to the end
                assert want is None, f"accepted a bad {want}"
                assert first is not None
                seen["ok"] = seen.get("ok", 0) + 1
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and want is None:
                    seen["ok"] = seen.get("ok", 0) + 1
                    return
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code()}: {exc.details()}"
                field = (exc.details() or "").split(":", 1)[0]
                # A valid-looking request may still be too long for the context once tokenized.
                assert field == want or (want is None and field == "prompt"), f"want {want}: {exc.details()}"
                seen[field] = seen.get(field, 0) + 1

        one()
    assert seen.get("ok", 0) >= 1 and len(seen) >= 5 and sum(seen.values()) >= 300, seen
    assert not dead_services(stack)
