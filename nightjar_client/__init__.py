"""Nightjar's Python SDK: sync ``Client`` and asyncio ``AsyncClient`` for the gRPC gateway.

See docs/client.md for runnable examples. Installs alone: ``pip install ./nightjar_client``.
"""

__version__ = "0.1.0"

from .aio import AsyncClient
from .client import Client
from .errors import (
    Aborted, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument, NightjarError,
    NotFound, OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable, Unimplemented, Unknown,
)
from .records import Completion, Delta, ModelInfo, Timings, Usage
from .retry import NO_RETRY, RetryPolicy

__all__ = [
    "__version__", "Client", "AsyncClient", "Completion", "Delta", "ModelInfo", "Usage", "Timings", "RetryPolicy", "NO_RETRY",
    "NightjarError", "InvalidArgument", "ResourceExhausted", "Unavailable", "DeadlineExceeded", "Unauthenticated",
    "PermissionDenied", "Cancelled", "NotFound", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
    "Internal", "DataLoss", "Unknown",
]
