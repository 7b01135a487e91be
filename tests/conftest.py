"""Shared fixtures. Integration tests use a real redis-server (never fakeredis)."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests run the small pair wherever they rely on the default one (nightjar/paths.py); the
# serving pair's own tests name it explicitly.
os.environ.setdefault("NIGHTJAR_DEFAULT_PAIR", "tiny")


@pytest.fixture(scope="session")
def redis_server():
    from nightjar_tools.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test, so tests sharing the server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:8]}"
