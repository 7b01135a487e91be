"""``nightjar health``: ask a service's gRPC health endpoint whether it is SERVING.

Exit 0 when SERVING, 1 otherwise; the compose healthchecks run it. Services without a gRPC
port (scheduler, planner, worker) are checked with ``--http URL`` instead: their Prometheus
endpoint answering 200 means the process is up; with ``--ready-metric NAME`` the scrape must also
hold a sample NAME of value 1 or more (the worker's ``nightjar_worker_ready``, set once its models
are loaded, since the endpoint itself answers from the start). ``--wait-s`` keeps
asking until the service serves or the time is up (useful in scripts that start a stack).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import grpc

from . import config
from .channel import sync_channel


# grpc.health.v1: the messages are one field each, so they are encoded here by hand rather than
# making the SDK depend on grpcio-health-checking (it needs grpcio and protobuf only).
_CHECK = "/grpc.health.v1.Health/Check"
_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _encode_request(service: str) -> bytes:
    """HealthCheckRequest{string service = 1}."""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def _decode_status(data: bytes) -> str:
    """HealthCheckResponse{ServingStatus status = 1} (an absent field is 0, UNKNOWN)."""
    from google.protobuf.internal.decoder import _DecodeVarint  # protobuf's own varint reader

    status, i = 0, 0
    while i < len(data):
        key, i = _DecodeVarint(data, i)
        if key & 7 != 0:  # only varint fields are expected in this message
            raise ValueError(f"unexpected wire type in a health response: {key}")
        value, i = _DecodeVarint(data, i)
        if key >> 3 == 1:
            status = value
    return _STATUS_NAMES.get(status, f"UNKNOWN({status})")


def check(target: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The health status name ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE: <code>"."""
    channel = sync_channel(target)
    try:
        call = channel.unary_unary(_CHECK, request_serializer=_encode_request, response_deserializer=_decode_status)
        return call(service, timeout=timeout_s)
    except grpc.RpcError as exc:
        return f"UNREACHABLE: {exc.code().name if exc.code() else 'UNKNOWN'}"
    finally:
        channel.close()


def check_http(url: str, timeout_s: float = 2.0, ready_metric: str | None = None) -> str:
    """"SERVING" when ``url`` answers 200 (and, given ``ready_metric``, its Prometheus text has
    a sample of that name with a value of at least 1); "NOT_SERVING" when the metric is absent
    or below 1; else "UNREACHABLE: <why>"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if resp.status != 200:
                return f"UNREACHABLE: HTTP {resp.status}"
            body = resp.read().decode("utf-8", "replace") if ready_metric else ""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"UNREACHABLE: {exc}"
    if ready_metric is None:
        return "SERVING"
    return "SERVING" if any(v >= 1 for v in _samples(body, ready_metric)) else "NOT_SERVING"


def _samples(text: str, name: str) -> list[float]:
    """Values of the samples called ``name`` in Prometheus text (no prometheus_client: the SDK
    depends on grpcio and protobuf only)."""
    values = []
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            rest = rest.rsplit("}", 1)[-1]
        try:
            values.append(float(rest.split()[0]))
        except (ValueError, IndexError):
            pass
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar health", description="Check a Nightjar service's gRPC health.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=config.env_target(), help=f"host:port (env {config.TARGET_ENV})")
    p.add_argument("--http", default=None, metavar="URL",
                   help="check this HTTP URL (a service's /metrics) instead of gRPC health")
    p.add_argument("--ready-metric", default=None, metavar="NAME",
                   help="with --http: also require a sample NAME >= 1 in the scrape (e.g. nightjar_worker_ready)")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="per-check timeout")
    p.add_argument("--wait-s", type=float, default=0.0, help="keep checking until SERVING for this long")
    p.add_argument("--quiet", action="store_true", help="print nothing, only set the exit code")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.http is None:
        try:
            config.check_target(args.target)
        except ValueError as exc:
            print(f"nightjar health: {exc}", file=sys.stderr)
            return 2
    elif not args.http.startswith(("http://", "https://")):
        print(f"nightjar health: --http must be an http:// or https:// URL, got {args.http!r}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait_s
    while True:
        if args.http is not None:
            status = check_http(args.http, args.timeout_s, args.ready_metric)
        else:
            status = check(args.target, args.service, args.timeout_s)
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not args.quiet:
        where = args.http or f"{args.target} {args.service or '(server)'}"
        print(f"{where}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
