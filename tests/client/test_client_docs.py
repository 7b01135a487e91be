"""Every ```python example in docs/client.md runs (here against the scripted gRPC server)."""

from __future__ import annotations

import pytest

from tests.client.conftest import FakeGateway, python_examples, run_example


def test_the_doc_has_examples():
    assert len(python_examples()) >= 5


@pytest.fixture(scope="module")
def gateway():
    with FakeGateway() as gw:
        yield gw


@pytest.mark.parametrize("index", range(len(python_examples())))
def test_example_runs(index, gateway, monkeypatch, capsys):
    monkeypatch.setenv("NIGHTJAR_TARGET", gateway.target)
    monkeypatch.delenv("NIGHTJAR_TOKEN", raising=False)
    calls = lambda: len(gateway.servicer.requests) + gateway.servicer.info_calls  # noqa: E731
    before = calls()
    run_example(python_examples()[index])
    assert capsys.readouterr().out  # every example prints what it got
    assert calls() > before  # and talked to the server
