"""The gateway's failure vocabulary. Only ``gateway.interceptors`` turns these into gRPC codes."""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every failure the gateway reports to a client on purpose."""


class InvalidArgument(GatewayError):
    """A request field is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class QueueFull(GatewayError):
    """Too many requests are waiting; the client should retry after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(GatewayError):
    """Redis is unreachable or the gateway is draining."""


class Unauthenticated(GatewayError):
    """Auth is on and the bearer token is missing or wrong."""


class DeadlineExceeded(GatewayError):
    """The request's deadline passed before it finished."""


class RequestFailed(GatewayError):
    """The request could not be run (e.g. it failed on too many workers)."""
