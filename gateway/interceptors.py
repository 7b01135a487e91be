"""The only place that knows gRPC status codes: exceptions in, codes out; plus bearer auth."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc
import redis.exceptions

from gateway import errors

log = logging.getLogger("gateway")

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.RequestFailed, grpc.StatusCode.INTERNAL),
    # Redis unreachable mid-request: the client may retry, like a draining gateway.
    (redis.exceptions.ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (redis.exceptions.TimeoutError, grpc.StatusCode.UNAVAILABLE),
)

# Probes and tooling must work without a token.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, details, trailing metadata) for an exception raised by a handler."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            trailer = (("retry-after-ms", str(exc.retry_after_ms)),) if isinstance(exc, errors.QueueFull) else ()
            detail = str(exc) if isinstance(exc, errors.GatewayError) else f"request queue unreachable: {exc}"
            return code, detail, trailer
    return grpc.StatusCode.INTERNAL, "internal error (see the gateway log)", ()


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, detail, trailer = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, errors.GatewayError):
        log.exception("unexpected error in a handler", exc_info=exc)
    await context.abort(code, detail, trailing_metadata=trailer)


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message (answered INVALID_ARGUMENT,
    not gRPC's default UNKNOWN, so a client can tell bad input from a server fault)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _lenient(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError, bad UTF-8, truncation
            return _Undecodable(str(exc))

    return parse


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise errors.InvalidArgument("request", f"is not a valid protobuf message ({request.why})")


def _rewrap(handler: grpc.RpcMethodHandler, before: Callable[[grpc.aio.ServicerContext], Awaitable[None]] | None) -> grpc.RpcMethodHandler:
    """The same handler with ``before`` run first and gateway exceptions turned into codes."""

    if handler.unary_stream:
        inner = handler.unary_stream

        async def unary_stream(request, context):
            try:
                if before:
                    await before(context)
                _check_decoded(request)
                async for response in inner(request, context):
                    yield response
            except (errors.GatewayError, redis.exceptions.RedisError) as exc:
                await _abort(context, exc)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=_lenient(handler.request_deserializer), response_serializer=handler.response_serializer)
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            try:
                if before:
                    await before(context)
                _check_decoded(request)
                return await inner_uu(request, context)
            except (errors.GatewayError, redis.exceptions.RedisError) as exc:
                await _abort(context, exc)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=_lenient(handler.request_deserializer), response_serializer=handler.response_serializer)
    return handler  # streaming-request methods (reflection) pass through untouched


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps gateway exceptions to status codes and, when a token is set, checks bearer auth."""

    def __init__(self, auth_token: str = "") -> None:
        self._expected = f"Bearer {auth_token}".encode() if auth_token else b""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        open_method = handler_call_details.method.startswith(_OPEN_PREFIXES)
        before = self._check_auth if self._expected and not open_method else None
        return _rewrap(handler, before)

    async def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
        # Constant-time: the comparison must not reveal how much of the token matched.
        if not hmac.compare_digest(got, self._expected):
            raise errors.Unauthenticated("missing or wrong bearer token (metadata 'authorization: Bearer <token>')")
