"""The OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models), served by
uvicorn in the gateway process beside gRPC and sharing its request path (gateway.inference):
the same admission, auth token, deadlines and cancellation.

Only this module knows HTTP status codes, as gateway.interceptors alone knows gRPC's. A client
that leaves (before or during its reply) cancels its request at the worker at once: every wait
races the connection's ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import redis.exceptions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.completion import Delta, Summary
from gateway.inference import Inference
from gateway.openai_params import parse
from gateway.validation import validate

log = logging.getLogger("gateway")

# JSON may spell one prompt byte as a six-character \\u escape; the rest is the other fields.
BODY_OVERHEAD_BYTES = 64 << 10


class HTTPError(Exception):
    """An HTTP-only refusal (unknown model, body too large) in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


class ClientGone(Exception):
    """The client closed the connection; nobody is left to answer."""


def error_response(exc: BaseException) -> Response:
    """OpenAI's error JSON, with the status that matches the gateway error."""
    headers: dict[str, str] = {}
    param = None
    if isinstance(exc, HTTPError):
        status, kind, code, param = exc.status, exc.kind, exc.code, exc.param
    elif isinstance(exc, errors.InvalidArgument):
        status, kind, code, param = 400, "invalid_request_error", None, exc.field
    elif isinstance(exc, errors.Unauthenticated):
        status, kind, code = 401, "authentication_error", "invalid_api_key"
    elif isinstance(exc, errors.QueueFull):
        status, kind, code = 429, "rate_limit_error", "queue_full"
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_ms / 1000))),
                   "retry-after-ms": str(exc.retry_after_ms)}
    elif isinstance(exc, (errors.Unavailable, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        status, kind, code = 503, "service_unavailable", None
    elif isinstance(exc, errors.DeadlineExceeded):
        status, kind, code = 504, "timeout", None
    else:
        if not isinstance(exc, errors.GatewayError):
            log.exception("unexpected error in an HTTP handler", exc_info=exc)
        status, kind, code = 500, "internal_error", None
    message = str(exc) if isinstance(exc, (errors.GatewayError, HTTPError)) else (
        f"request queue unreachable: {exc}" if status == 503 else "internal error (see the gateway log)")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class OpenAIFrontEnd:
    def __init__(self, inference: Inference, auth_token: str, served_model: str, chat_template: str | None) -> None:
        self._inference = inference
        self._expected = f"Bearer {auth_token}".encode() if auth_token else b""
        self._model = served_model
        self._template = chat_template if chat_template is not None else getattr(inference.tokenizer, "chat_template", None)
        self._body_cap = 6 * inference.limits.max_prompt_bytes + BODY_OVERHEAD_BYTES
        self._created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    # ------------------------------------------------------------------ endpoints

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except errors.GatewayError as exc:
            return error_response(exc)
        limits = self._inference.limits
        return JSONResponse({"object": "list", "data": [{
            "id": self._model, "object": "model", "created": self._created, "owned_by": "nightjar",
            "max_model_len": limits.max_context_tokens,
        }]})

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(HTTPError(404, f"no route {request.url.path}", "not_found_error"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(HTTPError(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error"))

    # ------------------------------------------------------------------ the shared shape

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            self._check_auth(request)  # before reading a byte of the body
            req = parse(await self._json(request), chat=chat)
            if req.model is not None and req.model != self._model:
                raise HTTPError(404, f"model {req.model!r} is not served here; GET /v1/models lists {self._model!r}",
                                "invalid_request_error", "model_not_found", "model")
            if chat:
                req.fields.prompt = self._render(req.messages)
            valid = validate(req.fields, self._inference.limits)
            request_id = self._inference.new_request_id()
            events = self._inference.generate(request_id, valid, _timeout_s(request), chat=chat)
            reply = _Reply(("chatcmpl-" if chat else "cmpl-") + request_id, self._model, chat)
            if not req.stream:
                deltas, summary = await _until_disconnect(request.receive, _collect(events))
                return JSONResponse(reply.whole("".join(d.text for d in deltas), summary))
            # The first event decides the status: refusals (queue full, prompt too long) arrive
            # before it as exceptions and become proper error codes, not an SSE error event.
            first = await _until_disconnect(request.receive, anext(events))
            return _SSE(reply.stream(first, events, req.include_usage))
        except ClientGone:
            return Response(status_code=499)  # never seen by the client; keeps the access log honest
        except (errors.GatewayError, HTTPError, redis.exceptions.RedisError) as exc:
            return error_response(exc)

    def _check_auth(self, request: Request) -> None:
        if not self._expected:
            return
        got = request.headers.get("authorization", "").encode("latin-1", errors="replace")
        # Constant-time: the comparison must not reveal how much of the token matched.
        if not hmac.compare_digest(got, self._expected):
            raise errors.Unauthenticated("missing or wrong API key (header 'Authorization: Bearer <key>')")

    async def _json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._body_cap:
            raise HTTPError(413, f"body of {declared} bytes is over the cap of {self._body_cap}", "invalid_request_error")
        body = bytearray()
        async for part in request.stream():  # chunked bodies are counted as they come
            body += part
            if len(body) > self._body_cap:
                raise HTTPError(413, f"body is over the cap of {self._body_cap} bytes", "invalid_request_error")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.InvalidArgument("body", f"is not valid JSON ({exc})") from None

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not self._template:
            raise errors.InvalidArgument(
                "messages", f"model {self._model!r} has no chat template; use /v1/completions, "
                "or start the gateway with --chat-template FILE")
        try:
            return self._inference.tokenizer.apply_chat_template(
                messages, chat_template=self._template, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template error (e.g. raise_exception on a role order it refuses)
            raise errors.InvalidArgument("messages", f"the chat template refused them: {exc}") from None


def _timeout_s(request: Request) -> float | None:
    """The client's deadline, from the optional 'nightjar-timeout-ms' header (relative)."""
    raw = request.headers.get("nightjar-timeout-ms")
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise errors.InvalidArgument("nightjar-timeout-ms", f"must be a positive integer of milliseconds, got {raw!r}")
    return int(raw) / 1000


async def _collect(events: AsyncIterator[Delta | Summary]) -> tuple[list[Delta], Summary]:
    deltas: list[Delta] = []
    async for event in events:
        if isinstance(event, Summary):
            return deltas, event
        deltas.append(event)
    raise errors.RequestFailed("the completion ended without a summary")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, work: Awaitable):
    """``work``'s result, or ClientGone after cancelling it (which cancels the request at the
    worker) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            raise ClientGone
    return task.result()


class _Reply:
    """OpenAI's JSON shapes for one completion (text or chat)."""

    def __init__(self, reply_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat = reply_id, model, chat
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(s: Summary) -> dict[str, int]:
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "total_tokens": s.prompt_tokens + s.completion_tokens}

    def whole(self, text: str, s: Summary) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": s.finish_reason}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {**self._head(False), "choices": [choice], "usage": self.usage(s)}

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _event({**self._head(True), "choices": [choice]})

    async def stream(self, first: Delta | Summary, events: AsyncIterator[Delta | Summary],
                     include_usage: bool) -> AsyncIterator[bytes]:
        if self.chat:
            yield self._chunk("", None, first=True)
        try:
            event = first
            while True:
                if isinstance(event, Summary):
                    yield self._chunk(None, event.finish_reason)
                    if include_usage:
                        yield _event({**self._head(True), "choices": [], "usage": self.usage(event)})
                    break
                if event.text:
                    yield self._chunk(event.text, None)
                event = await anext(events)
        except (errors.GatewayError, redis.exceptions.RedisError) as exc:
            # The status line is gone already: the error goes in the stream, as vLLM sends it.
            yield _event(json.loads(error_response(exc).body))
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _SSE:
    """A server-sent-events response that cancels its source the moment the client leaves,
    even while no token is due (Starlette's own notices only at its next write)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        try:
            await _until_disconnect(receive, self._pump(send))
        except (ClientGone, OSError):
            pass
        finally:
            await self._chunks.aclose()

    async def _pump(self, send: Send) -> None:
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
