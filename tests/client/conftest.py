"""A tiny scripted InferenceService on 127.0.0.1 (a real grpc.aio peer) for the SDK and CLI tests.

It runs in its own thread and event loop, so sync clients can call it from a test without
blocking the server. The prompt picks the behaviour (echo, failures, slowness): ``FakeInference``.
"""

from __future__ import annotations

import asyncio
import collections
import re
import threading
from pathlib import Path

import grpc

from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc


class FakeInference(pb_grpc.InferenceServiceServicer):
    """The prompt picks the behaviour:

    - ``"echo: a b c"``      streams "a", " b", " c" (token ids 1, 2, 3), finish "length" if max_tokens cut it, else "stop"
    - ``"unavailable:N ..."`` fails the first N attempts of this request_id with UNAVAILABLE, then echoes
    - ``"exhausted:N:MS ..."`` fails N attempts with RESOURCE_EXHAUSTED and trailing retry-after-ms=MS
    - ``"invalid"``           INVALID_ARGUMENT naming the field (also any temperature outside [0, 2])
    - ``"break-after:K ..."``  streams K tokens then fails UNAVAILABLE (every attempt)
    - ``"slow:S ..."``        waits S seconds before echoing (deadline tests)
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.attempts: collections.Counter[str] = collections.Counter()
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = 0
        self.info_calls = 0

    async def _auth(self, context) -> None:
        if self.token is None:
            return
        md = dict(context.invocation_metadata())
        if md.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def Generate(self, request, context):
        await self._auth(context)
        self.requests.append(request)
        key = request.request_id or request.prompt
        self.attempts[key] += 1
        attempt = self.attempts[key]
        head, _, rest = request.prompt.partition(" ")
        kind, _, arg = head.partition(":")
        if request.prompt == "invalid" or not 0 <= request.temperature <= 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in [0, 2]")
        if kind == "unavailable" and attempt <= int(arg):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if kind == "exhausted":
            n, _, ms = arg.partition(":")
            if attempt <= int(n):
                context.set_trailing_metadata((("retry-after-ms", ms),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if kind == "slow":
            await asyncio.sleep(float(arg))
        if kind == "echo":
            rest = arg + (" " + rest if rest else "")
        words = rest.split() if kind in ("echo", "unavailable", "exhausted", "break-after", "slow", "drip") else []
        # drip:<s> waits that long between tokens, so a client that stops early is still mid-stream
        # (without it the whole stream can be sent before the client's cancel arrives).
        gap_s = float(arg) if kind == "drip" else 0.0
        limit = request.max_tokens or 16
        out = words[:limit]
        rid = request.request_id or f"req-{len(self.requests)}"
        try:
            for i, word in enumerate(out):
                if kind == "break-after" and i == int(arg):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
                yield pb.GenerateResponse(request_id=rid, text=(" " if i else "") + word, token_ids=[i + 1])
                await asyncio.sleep(gap_s)
            reason = pb.FINISH_REASON_LENGTH if len(words) > limit else pb.FINISH_REASON_STOP
            yield pb.GenerateResponse(request_id=rid, finish_reason=reason,
                                      usage=pb.Usage(prompt_tokens=len(request.prompt.split()),
                                                     completion_tokens=len(out)),
                                      ttft_ms=1.5, e2e_ms=3.0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def GetModelInfo(self, request, context):
        await self._auth(context)
        self.info_calls += 1
        return pb.GetModelInfoResponse(model="tiny-target", draft_model="tiny-draft", max_context_tokens=2048,
                                       max_tokens_limit=512, vocab_size=4096, gamma_max=6)


class FakeGateway:
    """Start with ``with FakeGateway() as gw: gw.target``."""

    def __init__(self, token: str | None = None) -> None:
        self.servicer = FakeInference(token)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeGateway":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_InferenceServiceServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def run_example(code: str) -> None:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__docs__"})
