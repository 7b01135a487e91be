"""InferenceService: validate -> enqueue -> stream. Failures are exceptions (see interceptors)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from gateway.admission import AdmissionTable
from gateway.config import GatewayConfig
from gateway.errors import DeadlineExceeded, GatewayError, InvalidArgument, RequestFailed, Unavailable
from gateway.follower import RequestQueue
from gateway.text_stream import IndexDedup, StopCutter
from gateway.validation import Limits, check_length, validate
from nightjar import metrics as m
from nightjar.fast_tokenizer import FastTokenizer
from nightjar.messages import Job, OutputChunk
from nightjar.service_util import now_ms
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc
from worker.detokenizer import IncrementalDetokenizer

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, cfg: GatewayConfig, tokenizer, queue: RequestQueue, table: AdmissionTable) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._queue = queue
        self._table = table
        self._limits = Limits(cfg.default_max_tokens, cfg.max_tokens_limit, cfg.max_context_tokens)
        self._fast = FastTokenizer(tokenizer)  # encode and the detokenizers' decodes, minus the wrappers

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model=self._cfg.model_name, draft_model=self._cfg.draft_name,
            max_context_tokens=self._limits.max_context_tokens, max_tokens_limit=self._limits.max_tokens_limit,
            vocab_size=len(self._tokenizer), gamma_max=self._cfg.gamma_max,
        )

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        received_s = time.perf_counter()
        self._table.check_open()
        valid = validate(request, self._limits)
        prompt_ids = self._fast.encode(valid.prompt)
        check_length(len(prompt_ids), valid.params.max_tokens, self._limits)
        request_id = uuid.uuid4().hex
        remaining_s = context.time_remaining()
        entry = await self._table.admit(request_id)
        # The generator's finally does not run when gRPC drops a cancelled stream that is
        # suspended at a yield, so the RPC's done-callback closes it too (whichever is first).
        context.add_done_callback(lambda _ctx: self._close(entry))
        m.REQUESTS_WAITING.set(self._table.queued)
        try:
            await self._queue.enqueue(Job(
                request_id=request_id, prompt_token_ids=tuple(prompt_ids), params=dataclasses.asdict(valid.params),
                deadline_budget_ms=max(1, int(remaining_s * 1000)) if remaining_s is not None else 0,
                enqueued_unix_ms=now_ms(),
            ))
            reply_id = valid.client_request_id or request_id
            stream = _Completion(self._fast, prompt_ids, valid.params.stop, reply_id, received_s)
            try:
                async with asyncio.timeout(remaining_s):
                    async for batch in self._queue.outputs(request_id):
                        response, failure = stream.take(batch)
                        if response is not None:
                            if entry.first_token_s is None and response.token_ids:
                                self._table.first_token(entry)
                                m.REQUESTS_WAITING.set(self._table.queued)
                            yield response
                        if failure is not None:  # after the tokens that came before it
                            raise failure
                        if stream.done:
                            break
            except TimeoutError:
                raise DeadlineExceeded(f"deadline of {remaining_s:.3f}s passed after {stream.sent} tokens") from None
            entry.finished = stream.final_seen
            yield stream.last_response()
        finally:
            self._close(entry)

    def _close(self, entry) -> None:
        """Release the request's admission slot once; cancel it at the worker unless it finished."""
        if not self._table.release(entry):
            return
        if entry.finished:
            self._queue.forget_soon(entry.request_id)
        else:  # client gone, deadline, stop string seen first, or an error: free the worker's blocks
            self._queue.cancel_soon(entry.request_id, "cancelled")
        m.REQUESTS_WAITING.set(self._table.queued)


class _Completion:
    """One request's reply state: dedup by index, detokenize, cut at stop strings, usage."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops, reply_id: str, received_s: float) -> None:
        self._dedup = IndexDedup()
        self._detok = IncrementalDetokenizer(tokenizer)
        self._cutter = StopCutter(stops)
        self._reply_id = reply_id
        self._received_s = received_s
        self._prompt_tokens = len(prompt_ids)
        self._first_s: float | None = None
        self._last_s = received_s
        self.sent = 0
        self.done = False
        self.final_seen = False
        self._reason = pb.FINISH_REASON_UNSPECIFIED

    def take(self, chunks: list[OutputChunk]) -> tuple[pb.GenerateResponse | None, GatewayError | None]:
        """One response for a batch of output chunks (None when they only repeated sent tokens
        or held text back), and the error a chunk ended the request with, if one did: the
        response still carries the tokens before it."""
        new: list[int] = []
        text = ""
        failure = None
        for chunk in chunks:
            try:
                fresh, piece = self._absorb(chunk)
            except GatewayError as exc:
                failure = exc
                break
            new += fresh
            text += piece
            if self.done:
                break
        if not new and not text:
            return None, failure
        now = time.perf_counter()
        if self._first_s is None:
            self._first_s = now
        elif new:
            per_token = (now - self._last_s) / len(new)
            for _ in new:
                m.observe_inter_token(per_token)
        self._last_s = now
        self.sent += len(new)
        return pb.GenerateResponse(request_id=self._reply_id, text=text, token_ids=new), failure

    def _absorb(self, chunk: OutputChunk) -> tuple[list[int], str]:
        """The unsent tokens of one chunk and the text now safe to send."""
        if chunk.finish_reason in ("error", "abort", "deadline", "rejected"):
            self.done, self.final_seen = True, True
            if chunk.finish_reason == "deadline":
                raise DeadlineExceeded(chunk.error or "the request's deadline passed before it ran")
            if chunk.finish_reason == "rejected":  # the engine refused the parameters
                raise InvalidArgument("request", chunk.error or "refused by the engine")
            raise RequestFailed(chunk.error or f"the request ended with {chunk.finish_reason!r}")
        try:
            new = self._dedup.fresh(chunk.index, chunk.token_ids)
        except ValueError as exc:  # entries were lost (e.g. Redis restarted empty mid-request)
            raise Unavailable(f"the request's output stream lost entries ({exc}); retry the request") from None
        text = self._cutter.push(self._detok.push(new)) if new else ""
        if chunk.finish_reason is not None:
            self.done, self.final_seen = True, True
            text += self._cutter.push(self._detok.flush())  # bytes held for an unfinished character
            text += self._cutter.flush()  # held text that never became a stop string
            self._reason = FINISH.get(chunk.finish_reason, pb.FINISH_REASON_STOP)
        if self._cutter.stopped:
            self.done = True
            self._reason = pb.FINISH_REASON_STOP
        return new, text

    def last_response(self) -> pb.GenerateResponse:
        now = time.perf_counter()
        ttft_s = (self._first_s - self._received_s) if self._first_s is not None else None
        e2e_s = now - self._received_s
        reason = "stop" if self._reason == pb.FINISH_REASON_STOP else "length"
        m.observe_request_done(reason, self._prompt_tokens, self.sent, ttft_s, e2e_s, None)
        return pb.GenerateResponse(
            request_id=self._reply_id, finish_reason=self._reason,
            usage=pb.Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self.sent),
            ttft_ms=(ttft_s or 0.0) * 1000, e2e_ms=e2e_s * 1000,
        )
