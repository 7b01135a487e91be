"""Typed exceptions, one per gRPC status code, all subclasses of ``NightjarError``.

The SDK's callers catch these instead of ``grpc.RpcError``; this module is the only place in
the client that knows about gRPC status codes.
"""

from __future__ import annotations

from typing import Any

import grpc

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED (see inference.proto)


class NightjarError(Exception):
    """Any error the server or the SDK reports; ``code`` is the gRPC status (None = client-side)."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, details: str = "", request_id: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.details = details or message
        self.request_id = request_id

    @property
    def retryable(self) -> bool:
        return False


class InvalidArgument(NightjarError):
    """A request field is out of range; the message names it. Never retried."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(NightjarError):
    """The server's queue is full (``retry_after_s``: its suggested wait), or, without that hint,
    gRPC itself refused the call (headers or message over its size limits)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        # The gateway's queue cap always sends retry-after-ms; a refusal without it is about
        # this call's size, which the same call would meet again.
        return self.retry_after_s is not None


class Unavailable(NightjarError):
    """The server cannot be reached, is draining, or lost its queue store. Retried."""

    code = grpc.StatusCode.UNAVAILABLE

    @property
    def retryable(self) -> bool:
        return True


class DeadlineExceeded(NightjarError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(NightjarError):
    """Auth is on and the token is missing or wrong: pass ``token=`` (or set NIGHTJAR_TOKEN)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(NightjarError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Cancelled(NightjarError):
    code = grpc.StatusCode.CANCELLED


class NotFound(NightjarError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(NightjarError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(NightjarError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(NightjarError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(NightjarError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(NightjarError):
    code = grpc.StatusCode.INTERNAL


class DataLoss(NightjarError):
    code = grpc.StatusCode.DATA_LOSS


class Unknown(NightjarError):
    code = grpc.StatusCode.UNKNOWN


_BY_CODE: dict[grpc.StatusCode, type[NightjarError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ResourceExhausted, Unavailable, DeadlineExceeded, Unauthenticated,
                PermissionDenied, Cancelled, NotFound, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, DataLoss, Unknown)
}


def error_class(code: grpc.StatusCode) -> type[NightjarError]:
    return _BY_CODE.get(code, Unknown)


def retry_after_s(metadata: Any) -> float | None:
    """The server's ``retry-after-ms`` hint from (trailing) metadata, in seconds; None if absent or bad."""
    for key, value in metadata or ():
        if key.lower() == RETRY_AFTER_KEY:
            try:
                ms = float(value.decode() if isinstance(value, bytes) else value)
            except ValueError:
                return None
            return ms / 1000.0 if ms >= 0 and ms == ms else None  # ms == ms rejects NaN
    return None


def from_status(code: grpc.StatusCode, details: str, trailing_metadata: Any = (), request_id: str = "") -> NightjarError:
    """The typed exception for a status code, its details, and the call's trailing metadata."""
    cls = error_class(code)
    message = f"{code.name}: {details}" if details else code.name
    if cls is ResourceExhausted:
        return ResourceExhausted(message, details=details, request_id=request_id,
                                 retry_after_s=retry_after_s(trailing_metadata))
    return cls(message, details=details, request_id=request_id)


def from_rpc_error(err: grpc.RpcError, request_id: str = "") -> NightjarError:
    """Translate a sync or asyncio gRPC error (both are ``grpc.Call``-like) into a NightjarError."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else "") or ""
    try:
        trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else ()
    except Exception:  # a call that never started has no metadata to read
        trailing = ()
    return from_status(code or grpc.StatusCode.UNKNOWN, details, trailing, request_id)
