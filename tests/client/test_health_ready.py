"""`nightjar health --http URL --ready-metric NAME`: what compose's worker healthcheck runs.

The worker's /metrics answers while its models are still loading; only nightjar_worker_ready = 1
may make it healthy."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nightjar_client import health

BODY = {"text": ""}


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        data = BODY["text"].encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


LOADING = "# TYPE nightjar_worker_ready gauge\nnightjar_worker_ready 0.0\nnightjar_worker_ready_x 1.0\n"
READY = "# TYPE nightjar_worker_ready gauge\nnightjar_worker_ready 1.0\n"


@pytest.mark.parametrize("text, with_metric, expected", [
    (LOADING, False, 0),  # plain --http: the endpoint answering is enough
    (LOADING, True, 1),  # loading: a prefix-named series does not count
    ("process_cpu_seconds_total 1.0\n", True, 1),  # not exported at all
    (READY, True, 0),
    ('nightjar_worker_ready{model_name="m"} 1.0\n', True, 0),
])
def test_ready_metric(url, text, with_metric, expected):
    BODY["text"] = text
    argv = ["--http", url, "--quiet"] + (["--ready-metric", "nightjar_worker_ready"] if with_metric else [])
    assert health.main(argv) == expected


def test_worker_ready_gauge_is_exported_by_the_worker_role():
    from nightjar import metrics as m

    assert m.WORKER_READY in m.ROLES["worker"]
    assert all(m.WORKER_READY not in m.ROLES[r] for r in ("gateway", "planner", "scheduler"))


def test_grpc_check_without_grpcio_health_checking():
    """The SDK encodes grpc.health.v1 by hand; the real servicer must understand it, named
    service included, and every status must come back by name."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health as servicer_mod
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert health._encode_request("svc") == health_pb2.HealthCheckRequest(service="svc").SerializeToString()
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = servicer_mod.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        name = "nightjar.v1.InferenceService"
        for status in ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"):
            servicer.set(name, health_pb2.HealthCheckResponse.ServingStatus.Value(status))
            assert health.check(f"127.0.0.1:{port}", service=name) == status
    finally:
        server.stop(None)
