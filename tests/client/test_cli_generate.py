"""`nightjar generate` and `nightjar health`: argument parsing, output formats, exit codes (fake gateway)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nightjar_client import cli, config
from nightjar_client import health as health_cmd
from nightjar_tools.cli import COMMANDS
from nightjar_tools.cli import main as nightjar_main
from tests.client.conftest import FakeGateway


@pytest.fixture(scope="module")
def gateway():
    with FakeGateway() as gw:
        yield gw


def run(argv, stdin: str = ""):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(argv, out=out, err_out=err, stdin=io.StringIO(stdin))
    return code, out.getvalue(), err.getvalue()


def test_generate_prints_the_text(gateway):
    code, out, err = run(["echo: hello there world", "--max-tokens", "2", "--target", gateway.target])
    assert (code, out, err) == (0, "hello there\n", "")


def test_generate_json(gateway):
    code, out, _ = run(["echo: a b c", "--json", "--target", gateway.target, "--request-id", "cli-json"])
    assert code == 0
    doc = json.loads(out)
    assert doc["text"] == "a b c" and doc["token_ids"] == [1, 2, 3] and doc["finish_reason"] == "stop"
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 3}
    assert doc["timings"] == {"ttft_ms": 1.5, "e2e_ms": 3.0} and doc["request_id"] == "cli-json"


def test_stream_prints_as_tokens_arrive(gateway):
    code, out, _ = run(["echo: x y z", "--stream", "--target", gateway.target])
    assert (code, out) == (0, "x y z\n")
    code, out, _ = run(["echo: x y", "--stream", "--json", "--target", gateway.target])
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["text"] for d in lines] == ["x", " y", ""]
    assert lines[-1]["finish_reason"] == "stop" and lines[0]["finish_reason"] is None


def test_sampling_flags_reach_the_server(gateway):
    code, _, _ = run(["echo: q", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "42",
                      "--stop", "END", "STOP", "--ignore-eos", "--request-id", "cli-flags", "--target", gateway.target])
    assert code == 0
    req = next(r for r in gateway.servicer.requests if r.request_id == "cli-flags")
    assert (req.top_k, req.seed, list(req.stop), req.ignore_eos) == (5, 42, ["END", "STOP"], True)
    assert req.temperature == pytest.approx(0.7)


def test_prompt_from_stdin(gateway):
    code, out, _ = run(["-", "--target", gateway.target], stdin="echo: from stdin")
    assert (code, out) == (0, "from stdin\n")


def test_errors_and_exit_codes(gateway):
    code, out, err = run(["invalid", "--target", gateway.target])
    assert code == 2 and out == "" and "INVALID_ARGUMENT" in err and "temperature" in err
    code, _, err = run(["invalid", "--json", "--target", gateway.target])
    assert code == 2 and json.loads(err) == {"error": "INVALID_ARGUMENT", "message": "temperature must be in [0, 2]"}
    code, _, err = run(["echo: x", "--max-tokens", "-1", "--target", gateway.target])
    assert code == 2 and "max_tokens" in err
    code, _, err = run(["unavailable:9 x", "--retries", "0", "--target", gateway.target, "--request-id", "cli-u"])
    assert code == 1 and "UNAVAILABLE" in err
    assert gateway.servicer.attempts["cli-u"] == 1
    code, _, err = run(["echo: x", "--target", "http://nope:1"])
    assert code == 2 and "scheme" in err


def test_environment_supplies_target_and_token(monkeypatch):
    with FakeGateway(token="tok") as gw:
        monkeypatch.setenv(config.TARGET_ENV, gw.target)
        monkeypatch.setenv(config.TOKEN_ENV, "tok")
        assert run(["echo: env works"])[:2] == (0, "env works\n")
        code, _, err = run(["echo: x", "--token", "bad"])  # the flag wins over the environment
        assert code == 1 and "UNAUTHENTICATED" in err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert "(default: 0.0)" in text and "(default: 1.0)" in text and "--max-tokens" in text
    assert "NIGHTJAR_TOKEN" in text


def test_generate_and_health_are_in_the_command_table():
    assert COMMANDS["generate"][0] == "nightjar_client.cli:main"
    assert COMMANDS["health"][0] == "nightjar_client.health:main"


def test_health_command(capsys):
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert nightjar_main(["health", "--target", target]) == 0
        assert "SERVING" in capsys.readouterr().out
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert health_cmd.main(["--target", target, "--quiet"]) == 1
        assert capsys.readouterr().out == ""
        assert health_cmd.check(target, service="nightjar.v1.InferenceService").startswith("UNREACHABLE: NOT_FOUND")
    finally:
        server.stop(None)
    from nightjar_tools.redis_server import free_port
    assert health_cmd.main(["--target", f"127.0.0.1:{free_port()}", "--timeout-s", "0.5"]) == 1


def test_health_http_mode(capsys):
    import http.server
    import threading

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert health_cmd.main(["--http", f"{base}/metrics"]) == 0
        assert "SERVING" in capsys.readouterr().out
        assert health_cmd.main(["--http", f"{base}/nope", "--quiet"]) == 1
        assert health_cmd.main(["--http", "ftp://x"]) == 2
    finally:
        httpd.shutdown()


@pytest.mark.slow
def test_nightjar_generate_subprocess(gateway):
    """The installed entry point, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "nightjar", "generate", "echo: via the entry point", "--stream",
                           "--target", gateway.target], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "via the entry point\n"
