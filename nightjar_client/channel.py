"""Channel construction shared by the sync and asyncio clients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from .config import check_target

USER_AGENT = "nightjar-client/0.1"


def channel_args(target: str, tls: bool, root_certificates: bytes | None,
                 options: Sequence[tuple[str, Any]]) -> tuple[str, grpc.ChannelCredentials | None, list]:
    check_target(target)
    opts = [("grpc.primary_user_agent", USER_AGENT), *options]
    creds = grpc.ssl_channel_credentials(root_certificates) if (tls or root_certificates) else None
    return target, creds, opts


def sync_channel(target: str, tls: bool = False, root_certificates: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    target, creds, opts = channel_args(target, tls, root_certificates, options)
    return grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)


def aio_channel(target: str, tls: bool = False, root_certificates: bytes | None = None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    target, creds, opts = channel_args(target, tls, root_certificates, options)
    return grpc.aio.secure_channel(target, creds, opts) if creds else grpc.aio.insecure_channel(target, opts)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
