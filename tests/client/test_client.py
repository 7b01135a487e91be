"""SDK (sync and asyncio) against a real gRPC peer on 127.0.0.1: the scripted fake gateway."""

from __future__ import annotations

import time

import pytest

from nightjar_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NightjarError,
    ResourceExhausted,
    RetryPolicy,
    Unauthenticated,
    Unavailable,
)
from tests.client.conftest import FakeGateway

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01)


@pytest.fixture(scope="module")
def gateway():
    with FakeGateway() as gw:
        yield gw


@pytest.fixture
def client(gateway):
    sleeps: list[float] = []
    with Client(gateway.target, retry=FAST, sleep=sleeps.append) as c:
        c.sleeps = sleeps
        yield c


def test_generate_returns_a_completion(client):
    c = client.generate("echo: the quick brown fox", max_tokens=3, request_id="gen-1")
    assert c.text == "the quick brown"
    assert c.token_ids == (1, 2, 3)
    assert c.finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (5, 3)
    assert (c.timings.ttft_ms, c.timings.e2e_ms) == (1.5, 3.0)
    assert c.request_id == "gen-1"
    assert client.generate("echo: a b").finish_reason == "stop"


def test_stream_yields_deltas_then_the_final_record(client):
    deltas = list(client.stream("echo: one two three"))
    assert [d.text for d in deltas] == ["one", " two", " three", ""]
    assert [d.token_ids for d in deltas[:-1]] == [(1,), (2,), (3,)]
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "stop" and deltas[-1].usage.completion_tokens == 3


def test_request_fields_reach_the_server(client, gateway):
    client.generate("echo: x", max_tokens=7, temperature=0.5, top_p=0.8, top_k=9, seed=11, stop=["a", "b"],
                    request_id="fields-1")
    req = next(r for r in gateway.servicer.requests if r.request_id == "fields-1")
    assert (req.max_tokens, req.top_k, req.seed, list(req.stop)) == (7, 9, 11, ["a", "b"])
    assert req.temperature == pytest.approx(0.5) and req.top_p == pytest.approx(0.8)


def test_model_info(client):
    info = client.model_info()
    assert (info.model, info.draft_model, info.max_tokens_limit, info.gamma_max) == ("tiny-target", "tiny-draft", 512, 6)


def test_unavailable_is_retried_with_backoff(client, gateway):
    c = client.generate("unavailable:2 ok then", request_id="unav-1")
    assert c.text == "ok then"
    assert gateway.servicer.attempts["unav-1"] == 3
    assert len(client.sleeps) == 2 and client.sleeps[0] <= client.sleeps[1] * 2 + 1e-9


def test_retries_give_up_after_max_attempts(client, gateway):
    with pytest.raises(Unavailable, match="draining"):
        client.generate("unavailable:10 never", request_id="unav-2")
    assert gateway.servicer.attempts["unav-2"] == FAST.max_attempts


def test_resource_exhausted_honours_retry_after(client, gateway):
    c = client.generate("exhausted:1:250 fine", request_id="rex-1")
    assert c.text == "fine"
    assert gateway.servicer.attempts["rex-1"] == 2
    assert client.sleeps == [pytest.approx(0.25, rel=0.11)]  # the hint, not the 1 ms backoff


def test_resource_exhausted_surfaces_the_hint_when_out_of_attempts(gateway):
    with Client(gateway.target, retry=RetryPolicy(max_attempts=1)) as c:
        with pytest.raises(ResourceExhausted) as info:
            c.generate("exhausted:5:1500 x", request_id="rex-2")
    assert info.value.retry_after_s == pytest.approx(1.5)


def test_invalid_argument_is_never_retried(client, gateway):
    with pytest.raises(InvalidArgument, match="temperature"):
        client.generate("invalid")
    assert gateway.servicer.attempts["invalid"] == 1
    assert client.sleeps == []


def test_stream_is_not_retried_after_tokens(client, gateway):
    got = []
    with pytest.raises(Unavailable, match="worker died"):
        for d in client.stream("break-after:2 a b c d", request_id="brk-1"):
            got.append(d.text)
    assert got == ["a", " b"]
    assert gateway.servicer.attempts["brk-1"] == 1


def test_deadline_exceeded(gateway):
    with Client(gateway.target, retry=FAST) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.generate("slow:2 late", deadline_s=0.2)
        assert time.monotonic() - t0 < 1.5


def test_breaking_out_of_a_stream_cancels_it(gateway):
    before = gateway.servicer.cancelled
    with Client(gateway.target) as c:
        stream = c.stream("drip:0.01 " + " ".join(["w"] * 200), max_tokens=200)
        assert next(stream).text == "w"
        stream.close()
    deadline = time.monotonic() + 15  # generous: the CI box is shared and loaded
    while gateway.servicer.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gateway.servicer.cancelled > before


def test_closed_client_refuses_calls(gateway):
    c = Client(gateway.target)
    c.close()
    c.close()  # idempotent
    with pytest.raises(NightjarError, match="closed"):
        c.generate("echo: x")


def test_unreachable_server_is_unavailable():
    from nightjar_tools.redis_server import free_port

    sleeps: list[float] = []
    with Client(f"127.0.0.1:{free_port()}", retry=FAST, sleep=sleeps.append) as c:
        with pytest.raises(Unavailable):
            c.generate("echo: x")
    assert len(sleeps) == FAST.max_attempts - 1


def test_token_is_sent_as_bearer_metadata():
    with FakeGateway(token="s3cret") as gw:
        with Client(gw.target, token="s3cret") as good:
            assert good.generate("echo: ok").text == "ok"
        with Client(gw.target, token="wrong") as bad:
            with pytest.raises(Unauthenticated):
                bad.generate("echo: ok")
        with Client(gw.target) as none:
            with pytest.raises(Unauthenticated):
                none.model_info()


# ------------------------------------------------------------------------- asyncio


async def test_async_generate_stream_and_info(gateway):
    async with AsyncClient(gateway.target, retry=FAST) as c:
        comp = await c.generate("echo: alpha beta", request_id="aio-1")
        assert (comp.text, comp.token_ids, comp.finish_reason) == ("alpha beta", (1, 2), "stop")
        texts = [d.text async for d in c.stream("echo: x y z", max_tokens=2)]
        assert texts == ["x", " y", ""]
        assert (await c.model_info()).vocab_size == 4096


async def test_async_retries_and_errors(gateway):
    sleeps: list[float] = []

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    async with AsyncClient(gateway.target, retry=FAST, sleep=fake_sleep) as c:
        assert (await c.generate("unavailable:1 back", request_id="aio-unav")).text == "back"
        assert len(sleeps) == 1
        comp = await c.generate("exhausted:1:40 ok", request_id="aio-rex")
        assert comp.text == "ok" and sleeps[-1] == pytest.approx(0.04, rel=0.11)
        with pytest.raises(InvalidArgument):
            await c.generate("invalid")
        got = []
        with pytest.raises(Unavailable):
            async for d in c.stream("break-after:1 a b", request_id="aio-brk"):
                got.append(d.text)
        assert got == ["a"] and gateway.servicer.attempts["aio-brk"] == 1
        with pytest.raises(InvalidArgument, match="max_tokens"):
            c.stream("x", max_tokens=-3)  # raised at once, before any I/O
