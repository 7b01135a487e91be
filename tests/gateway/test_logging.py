"""--log-format json: one parseable object per line, with the request fields the gateway logs."""

from __future__ import annotations

import io
import json
import logging

import pytest

from gateway.completion import Summary
from gateway.inference import log_finished, request_log
from nightjar.service_util import JsonFormatter, env_defaults, setup_logging


def _capture(fmt: logging.Formatter, logger: logging.Logger):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    return buf, lambda: (logger.removeHandler(handler), logger.setLevel(old))


def test_finished_request_is_one_json_line():
    buf, undo = _capture(JsonFormatter("gateway"), request_log)
    try:
        log_finished("abc123", Summary("length", prompt_tokens=7, completion_tokens=16, ttft_s=0.025, e2e_s=0.5))
        log_finished("def456", Summary("stop", prompt_tokens=3, completion_tokens=0, ttft_s=None, e2e_s=0.01))
    finally:
        undo()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["service"] == "gateway" and first["level"] == "INFO" and first["logger"] == "gateway.requests"
    assert (first["request_id"], first["finish_reason"], first["prompt_tokens"], first["completion_tokens"]) == (
        "abc123", "length", 7, 16)
    assert first["ttft_s"] == 0.025 and first["e2e_s"] == 0.5
    assert "abc123" in first["msg"] and isinstance(first["ts"], float)
    assert second["ttft_s"] is None and second["finish_reason"] == "stop"


def test_json_lines_carry_tracebacks():
    log = logging.getLogger("nightjar.test.json")
    buf, undo = _capture(JsonFormatter("worker[w1]"), log)
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("step failed")
    finally:
        undo()
    doc = json.loads(buf.getvalue())
    assert doc["level"] == "ERROR" and doc["service"] == "worker[w1]" and "RuntimeError: boom" in doc["exc"]


def test_log_format_is_validated_and_read_from_the_environment():
    with pytest.raises(ValueError, match="log format"):
        setup_logging("INFO", "x", "xml")
    assert env_defaults({"NIGHTJAR_LOG_FORMAT": "json"}).log_format == "json"
    assert env_defaults({}).log_format == "text"


@pytest.mark.parametrize("module", ["gateway.__main__", "worker.__main__", "scheduler_svc.__main__",
                                    "planner_svc.__main__"])
def test_every_service_takes_log_format(module):
    import importlib

    main = importlib.import_module(module)
    cfg = main.parse_config(["--log-format", "json"])
    assert cfg.log_format == "json"
    with pytest.raises(SystemExit):
        main.parse_config(["--log-format", "xml"])

