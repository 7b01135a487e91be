"""The asyncio client (grpc.aio): the same calls as ``Client``, awaited.

>>> async with AsyncClient("127.0.0.1:50051") as client:              # doctest: +SKIP
...     async for delta in client.stream("Once upon a time", max_tokens=16):
...         print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from ._v1 import inference_pb2 as pb
from ._v1 import inference_pb2_grpc as pb_grpc

from . import config
from .channel import aio_channel, auth_metadata
from .errors import NightjarError, Unavailable, from_rpc_error
from .records import Accumulator, Completion, Delta, ModelInfo, build_request, delta_from, model_info_from
from .retry import Attempts, RetryPolicy


class AsyncClient:
    """Create it inside a running event loop; ``await close()`` (or ``async with``) releases it."""

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float | None = None,
                 retry: RetryPolicy | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = (), sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = auth_metadata(token)
        self._channel = aio_channel(target, tls, root_certificates, options)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._sleep, self._clock, self._rng = sleep, clock, rng or random.Random()
        self._closed = False

    @classmethod
    def from_env(cls, **kw: Any) -> "AsyncClient":
        kw.setdefault("token", config.env_token())
        return cls(config.env_target(), **kw)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"UNAVAILABLE: no connection to {self.target} within {timeout_s}s") from None

    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
                       ignore_eos: bool = False, request_id: str = "", deadline_s: float | None = None) -> Completion:
        acc = Accumulator()
        async for delta in self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                       request_id=request_id, deadline_s=deadline_s):
            acc.add(delta)
        return acc.completion()

    def stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
               ignore_eos: bool = False, request_id: str = "", deadline_s: float | None = None) -> AsyncIterator[Delta]:
        """Deltas as they arrive (parameters as ``Client.stream``); invalid fields raise here, at once."""
        req = build_request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=stop, ignore_eos=ignore_eos, request_id=request_id)
        return self._stream(req, self._attempts(deadline_s))

    async def model_info(self, *, deadline_s: float | None = None) -> ModelInfo:
        attempts = self._attempts(deadline_s)
        while True:
            try:
                resp = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=attempts.remaining_s(),
                                                     metadata=self._metadata)
                return model_info_from(resp)
            except grpc.RpcError as exc:
                await self._backoff_or_raise(attempts, from_rpc_error(exc))

    def _attempts(self, deadline_s: float | None) -> Attempts:
        if self._closed:
            raise NightjarError("the client is closed")
        return Attempts(self.retry, deadline_s if deadline_s is not None else self.timeout_s,
                        clock=self._clock, rng=self._rng)

    async def _backoff_or_raise(self, attempts: Attempts, err: NightjarError) -> None:
        delay = attempts.next_delay(err)
        if delay is None:
            raise err from None
        await self._sleep(delay)

    async def _stream(self, req: pb.GenerateRequest, attempts: Attempts) -> AsyncIterator[Delta]:
        while True:
            call = self._stub.Generate(req, timeout=attempts.remaining_s(), metadata=self._metadata)
            started = False
            try:
                async for resp in call:
                    delta = delta_from(resp)
                    started = started or bool(delta.text or delta.token_ids)
                    yield delta
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc, req.request_id)
                if started:
                    raise err from None  # tokens already went to the caller: a retry would repeat them
                await self._backoff_or_raise(attempts, err)
            finally:
                call.cancel()  # frees the server's work when the caller stopped early
