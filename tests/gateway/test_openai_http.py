"""The OpenAI-compatible HTTP API.

Quick tests: the real gateway in this process (real uvicorn on loopback, real redis-server),
the test playing the back end as in test_gateway_service. Slow tests: a whole stack with the
shipped models, driven by the official ``openai`` package, checked against the gRPC path.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.server import Gateway
from nightjar.messages import Job, OutputChunk
from nightjar.service_util import connect_redis
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from nightjar_tools.redis_server import EmbeddedRedis
from nightjar_tools.stack import Stack, StackConfig
from tests.conftest import pair, tokenizer
from tests.gateway.conftest import take_job

KEY = "sk-test-" + "k" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
# A template of the shape real checkpoints ship: roles in markers, then the assistant's turn.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# --------------------------------------------------------------------------- in-process gateway


class Rig:
    def __init__(self, gw: Gateway, redis) -> None:
        self.gw, self.redis, self.keys = gw, redis, gw.keys
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=10)

    async def next_job(self, timeout_s: float = 5.0) -> Job:
        return await take_job(self.redis, self.keys, timeout_s)

    async def emit(self, rid: str, index: int, toks, finish: str | None = None) -> None:
        chunk = OutputChunk(rid, index, tuple(toks), finish_reason=finish)
        await self.redis.xadd(self.keys.output(rid), {b"c": chunk.encode()})


async def start_rig(redis_url: str, prefix: str, **kw) -> Rig:
    target, draft = pair()
    cfg = GatewayConfig(**{**dict(port=0, http_port=0, redis_url=redis_url, key_prefix=prefix, target_path=Path(target),
                                  draft_path=Path(draft), require_worker=False, health_interval_s=0.05,
                                  redis_timeout_s=0.3, read_block_ms=200, auth_token=KEY), **kw})
    gw = Gateway(cfg, tokenizer=tokenizer(target))
    await gw.start()
    await asyncio.sleep(0.15)  # first health poll
    return Rig(gw, connect_redis(redis_url))


async def stop_rig(rig: Rig) -> None:
    await rig.http.aclose()
    await rig.gw.drain_and_stop()
    await rig.redis.aclose()


@pytest.fixture
async def rig(redis_url, key_prefix, request):
    r = await start_rig(redis_url, key_prefix, **getattr(request, "param", {}))
    yield r
    await stop_rig(r)


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


async def test_completion_maps_fields_and_reports_usage(rig):
    ids = rig.gw.inference.fast.encode("hello world, again")[:3]
    task = asyncio.create_task(rig.http.post("/v1/completions", headers=AUTH, json={
        "model": "tiny-target", "prompt": "hi", "max_tokens": 3, "temperature": 0, "top_k": 5, "seed": 7,
        "stop": ["zz"], "n": 1, "presence_penalty": 0, "user": "u1"}))
    job = await rig.next_job()
    assert job.params["max_tokens"] == 3 and job.params["temperature"] == 0 and job.params["top_k"] == 5
    assert job.params["seed"] == 7 and job.params["stop"] == ["zz"]
    await rig.emit(job.request_id, 0, ids, finish="length")
    resp = await task
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{job.request_id}"
    assert body["choices"][0]["text"] == rig.gw.inference.fast.decode(ids)
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len(rig.gw.inference.fast.encode("hi"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}


async def test_models_lists_the_served_model_with_its_context(rig):
    resp = await rig.http.get("/v1/models", headers=AUTH)
    assert resp.status_code == 200
    (model,) = resp.json()["data"]
    assert model["id"] == "tiny-target" and model["max_model_len"] == rig.gw.inference.limits.max_context_tokens


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
async def test_bad_or_missing_key_is_401(rig, headers):
    for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET")):
        resp = await rig.http.request(method, path, headers=headers, json={"prompt": "hi"})
        assert resp.status_code == 401 and error_of(resp)["type"] == "authentication_error"
    assert await rig.redis.xlen(rig.keys.requests) == 0  # nothing was enqueued


@pytest.mark.parametrize("field,value", [
    ("n", 2), ("logprobs", 1), ("top_logprobs", 3), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("repetition_penalty", 1.2), ("min_p", 0.1), ("best_of", 3), ("echo", True), ("logit_bias", {"5": 1}),
    ("suffix", "end"), ("guided_json", {}), ("banana", 1),
])
async def test_fields_the_engine_lacks_are_refused_by_name(rig, field, value):
    resp = await rig.http.post("/v1/completions", headers=AUTH, json={"prompt": "hi", field: value})
    err = error_of(resp)
    assert resp.status_code == 400 and err["param"] == field and field in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": 3}, "temperature"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
])
async def test_wrong_types_and_ranges_are_400_naming_the_field(rig, body, param):
    resp = await rig.http.post("/v1/completions", headers=AUTH, json=body)
    assert resp.status_code == 400 and error_of(resp)["param"] == param, resp.text


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b"\xff\xfe", b'"just a string"'])
async def test_malformed_json_is_400(rig, raw):
    resp = await rig.http.post("/v1/completions", headers={**AUTH, "content-type": "application/json"}, content=raw)
    assert resp.status_code == 400 and error_of(resp)["param"] == "body", resp.text


async def test_huge_body_is_413_and_a_prompt_over_the_context_is_400_before_tokenizing(rig):
    resp = await rig.http.post("/v1/completions", headers=AUTH, content=b'{"prompt": "' + b"a" * (8 << 20) + b'"}')
    assert resp.status_code == 413 and "cap" in error_of(resp)["message"]
    cap = rig.gw.inference.limits.max_prompt_bytes
    resp = await rig.http.post("/v1/completions", headers=AUTH, json={"prompt": "a" * (cap + 1)})
    assert resp.status_code == 400 and error_of(resp)["param"] == "prompt" and "context" in error_of(resp)["message"]


async def test_wrong_model_is_404(rig):
    resp = await rig.http.post("/v1/completions", headers=AUTH, json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found"


async def test_chat_without_a_template_is_a_clear_400(rig):
    resp = await rig.http.post("/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}]})
    err = error_of(resp)
    assert resp.status_code == 400 and "no chat template" in err["message"] and "--chat-template" in err["message"]


@pytest.mark.parametrize("rig", [{"max_queued": 1}], indirect=True)
async def test_queue_full_is_429_with_retry_after(rig):
    first = asyncio.create_task(rig.http.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}))
    job = await rig.next_job()  # admitted, waiting for its first token
    resp = await rig.http.post("/v1/completions", headers=AUTH, json={"prompt": "one too many"})
    assert resp.status_code == 429 and error_of(resp)["type"] == "rate_limit_error"
    assert int(resp.headers["Retry-After"]) >= 1 and int(resp.headers["retry-after-ms"]) >= 200
    await rig.emit(job.request_id, 0, [5, 6], finish="length")
    assert (await first).status_code == 200


async def test_redis_down_is_503(key_prefix):
    with EmbeddedRedis() as server:
        rig = await start_rig(server.url, key_prefix)
        try:
            server.stop()
            for _ in range(50):  # the health poll notices
                if not rig.gw.table.redis_ok:
                    break
                await asyncio.sleep(0.05)
            resp = await rig.http.post("/v1/completions", headers=AUTH, json={"prompt": "hi"})
            assert resp.status_code == 503 and error_of(resp)["type"] == "service_unavailable"
        finally:
            await stop_rig(rig)


async def test_stream_sends_sse_usage_then_done(rig):
    ids = rig.gw.inference.fast.encode("one two three four")[:4]

    async def read():
        events = []
        async with rig.http.stream("POST", "/v1/completions", headers=AUTH, json={
                "prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line:
                    events.append(line)
        return events

    task = asyncio.create_task(read())
    job = await rig.next_job()
    await rig.emit(job.request_id, 0, ids[:2])
    await rig.emit(job.request_id, 2, ids[2:], finish="length")
    events = await task
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == rig.gw.inference.fast.decode(ids)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_client_disconnect_cancels_the_request_at_the_worker(rig):
    """Both while waiting for the first token and mid-stream: the cancel key appears at once."""
    for tokens_first in (False, True):
        async with httpx.AsyncClient(base_url=str(rig.http.base_url), timeout=10) as client:
            req = client.build_request("POST", "/v1/completions", headers=AUTH,
                                       json={"prompt": "hi", "max_tokens": 50, "stream": True})
            task = asyncio.create_task(client.send(req, stream=True))
            job = await rig.next_job()
            if tokens_first:
                await rig.emit(job.request_id, 0, [5])
                resp = await task
                await anext(resp.aiter_lines())
                await resp.aclose()
            else:
                await asyncio.sleep(0.1)
                task.cancel()
        # closing the client closes its connection
        for _ in range(100):
            if await rig.redis.exists(rig.keys.cancel(job.request_id)):
                break
            await asyncio.sleep(0.02)
        assert await rig.redis.exists(rig.keys.cancel(job.request_id)), f"no cancel (tokens first: {tokens_first})"
        assert rig.gw.table.in_flight == 0


# --------------------------------------------------------------------------- whole stack


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    target, draft = pair()
    cfg = StackConfig(port=0, http_port=0, workers=1, redis_url=redis_server.url, key_prefix=f"h{uuid.uuid4().hex[:8]}",
                      target_path=Path(target), draft_path=Path(draft), api_key=KEY,
                      gateway_args=("--chat-template", str(template)))
    with Stack(cfg) as s:
        yield s


def grpc_text(stack: Stack, prompt: str, max_tokens: int) -> str:
    with grpc.insecure_channel(stack.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        out = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), metadata=(("authorization", f"Bearer {KEY}"),))
        return "".join(r.text for r in out)


PROMPT = "def fibonacci(n):"


@pytest.mark.slow
def test_sync_client_matches_grpc_and_streams_the_same_text(stack):
    client = openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0)
    whole = client.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == grpc_text(stack, PROMPT, 12) and whole.choices[0].text
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens == len(tokenizer(pair()[0]).encode(PROMPT))
    parts, usage = [], None
    for chunk in client.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        parts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].text and usage.completion_tokens == whole.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny-target"]


@pytest.mark.slow
def test_sync_client_errors_are_typed(stack):
    gateway = stack.service("gateway")  # the key reached it through its environment, not its argv
    assert KEY not in " ".join(gateway.args) and KEY.encode() not in Path(f"/proc/{gateway.proc.pid}/cmdline").read_bytes()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.http_url, api_key="nope", max_retries=0).completions.create(
            model="tiny-target", prompt="hi", max_tokens=2)
    client = openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-target", prompt="hi", max_tokens=2, n=2)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert exc.value.body["param"] == "logprobs"


@pytest.mark.slow
async def test_async_chat_uses_the_template_and_streams(stack):
    client = openai.AsyncOpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0)
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": PROMPT}]
    rendered = "<|system|>Write Python.\n<|user|>" + PROMPT + "\n<|assistant|>"
    whole = await client.chat.completions.create(model="tiny-target", messages=messages, max_completion_tokens=10,
                                                 temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == grpc_text(stack, rendered, 10)
    assert whole.usage.prompt_tokens == len(tokenizer(pair()[0]).encode(rendered, add_special_tokens=False))
    text = ""
    async for chunk in await client.chat.completions.create(model="tiny-target", messages=messages, max_tokens=10,
                                                            temperature=0, stream=True):
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == whole.choices[0].message.content
    # Concurrent async completions each get their own, complete answer.
    many = await asyncio.gather(*(client.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=6,
                                                             temperature=0) for _ in range(4)))
    assert len({m.choices[0].text for m in many}) == 1 and all(m.usage.completion_tokens > 0 for m in many)
    await client.close()


async def test_deadline_header_is_504_and_cancels_at_the_worker(rig):
    t0 = time.perf_counter()
    task = asyncio.create_task(rig.http.post("/v1/completions", json={"prompt": "hi"},
                                             headers={**AUTH, "nightjar-timeout-ms": "300"}))
    job = await rig.next_job()
    assert 0 < job.deadline_budget_ms <= 300  # the worker knows it too, as for a gRPC deadline
    resp = await task
    assert resp.status_code == 504 and error_of(resp)["type"] == "timeout"
    assert 0.25 < time.perf_counter() - t0 < 3.0
    await asyncio.sleep(0.1)
    assert await rig.redis.exists(rig.keys.cancel(job.request_id))
    bad = await rig.http.post("/v1/completions", json={"prompt": "hi"}, headers={**AUTH, "nightjar-timeout-ms": "soon"})
    assert bad.status_code == 400 and error_of(bad)["param"] == "nightjar-timeout-ms"
