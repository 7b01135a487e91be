"""The synchronous client: ``Client("host:port")``, ``generate``, ``stream``, ``model_info``.

>>> with Client("127.0.0.1:50051") as client:                      # doctest: +SKIP
...     print(client.generate("Once upon a time", max_tokens=16).text)

Retries (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED`` with the queue's retry-after hint) follow ``RetryPolicy``; a stream is never
retried once it has yielded tokens. ``deadline_s`` bounds the whole call, retries included.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from ._v1 import inference_pb2 as pb
from ._v1 import inference_pb2_grpc as pb_grpc

from . import config
from .channel import auth_metadata, sync_channel
from .errors import NightjarError, Unavailable, from_rpc_error
from .records import Accumulator, Completion, Delta, ModelInfo, build_request, delta_from, model_info_from
from .retry import Attempts, RetryPolicy


class Client:
    """A connection to a Nightjar gateway; close it (or use ``with``) to release the channel.

    ``timeout_s`` is the default deadline of every call (None = none); each call's
    ``deadline_s`` overrides it. ``sleep``/``clock``/``rng`` exist for tests.
    """

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float | None = None,
                 retry: RetryPolicy | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = (), sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = auth_metadata(token)
        self._channel = sync_channel(target, tls, root_certificates, options)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._sleep, self._clock, self._rng = sleep, clock, rng or random.Random()
        self._closed = False

    @classmethod
    def from_env(cls, **kw: Any) -> "Client":
        """A client for ``$NIGHTJAR_TARGET`` (default 127.0.0.1:50051) with ``$NIGHTJAR_TOKEN``."""
        kw.setdefault("token", config.env_token())
        return cls(config.env_target(), **kw)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel is connected; raises Unavailable after ``timeout_s``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"UNAVAILABLE: no connection to {self.target} within {timeout_s}s") from None

    # ---------------------------------------------------------------- calls
    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
                 ignore_eos: bool = False, request_id: str = "", deadline_s: float | None = None) -> Completion:
        """The whole completion of ``prompt`` (see ``stream`` for the parameters)."""
        acc = Accumulator()
        for delta in self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed, stop=stop, ignore_eos=ignore_eos, request_id=request_id,
                                 deadline_s=deadline_s):
            acc.add(delta)
        return acc.completion()

    def stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
               ignore_eos: bool = False, request_id: str = "", deadline_s: float | None = None) -> Iterator[Delta]:
        """Deltas (new text and token ids) as the server produces them; the last has finish_reason.

        ``max_tokens`` None = the server's default; ``temperature`` 0 = greedy; ``top_p`` 1 and
        ``top_k`` 0 = off; ``seed`` makes sampling reproducible; generation stops before any
        ``stop`` string. Stopping the iteration early cancels the request on the server.
        Raises a ``NightjarError`` subclass (InvalidArgument at once, before any network I/O, for
        a negative or mistyped field).
        """
        req = build_request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=stop, ignore_eos=ignore_eos, request_id=request_id)
        attempts = self._attempts(deadline_s)  # the deadline starts now, not at the first next()
        return self._stream(req, attempts)

    def model_info(self, *, deadline_s: float | None = None) -> ModelInfo:
        attempts = self._attempts(deadline_s)
        while True:
            try:
                resp = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=attempts.remaining_s(),
                                               metadata=self._metadata)
                return model_info_from(resp)
            except grpc.RpcError as exc:
                self._backoff_or_raise(attempts, from_rpc_error(exc))

    # ---------------------------------------------------------------- internals
    def _attempts(self, deadline_s: float | None) -> Attempts:
        if self._closed:
            raise NightjarError("the client is closed")
        return Attempts(self.retry, deadline_s if deadline_s is not None else self.timeout_s,
                        clock=self._clock, rng=self._rng)

    def _backoff_or_raise(self, attempts: Attempts, err: NightjarError) -> None:
        delay = attempts.next_delay(err)
        if delay is None:
            raise err from None
        self._sleep(delay)

    def _stream(self, req: pb.GenerateRequest, attempts: Attempts) -> Iterator[Delta]:
        while True:
            call = self._stub.Generate(req, timeout=attempts.remaining_s(), metadata=self._metadata)
            started = False
            try:
                for resp in call:
                    delta = delta_from(resp)
                    started = started or bool(delta.text or delta.token_ids)
                    yield delta
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc, req.request_id)
                if started:
                    raise err from None  # tokens already went to the caller: a retry would repeat them
                self._backoff_or_raise(attempts, err)
            finally:
                call.cancel()  # no-op when finished; frees the server's work when the caller stopped early
