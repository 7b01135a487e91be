"""The SDK's and CLI's environment, read in this one place.

``NIGHTJAR_TARGET`` (host:port of the gateway) and ``NIGHTJAR_TOKEN`` (bearer token, when the
gateway has auth on). Explicit arguments always win over the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "NIGHTJAR_TARGET"
TOKEN_ENV = "NIGHTJAR_TOKEN"


def env_target(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(TARGET_ENV) or DEFAULT_TARGET


def env_token(environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get(TOKEN_ENV) or None


def check_target(target: str) -> str:
    """``host:port`` (or a gRPC URI such as ``unix:/path``); raises ValueError saying what is wrong."""
    if not target or not isinstance(target, str):
        raise ValueError(f"target must be 'host:port', got {target!r}")
    if "://" in target:
        raise ValueError(f"target must be 'host:port' without a scheme, got {target!r} (drop the 'http://')")
    if target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target must be 'host:port' with a port 1-65535, got {target!r}")
    return target
