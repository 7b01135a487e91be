"""One request's reply state, transport-neutral: dedup by index, detokenize, cut at stop strings,
usage. The gRPC servicer and the OpenAI HTTP front end both turn its Deltas and Summary into
their own wire shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.errors import DeadlineExceeded, GatewayError, InvalidArgument, RequestFailed, Unavailable
from gateway.text_stream import IndexDedup, StopCutter
from nightjar import metrics as m
from nightjar.messages import OutputChunk
from nightjar.text import IncrementalDetokenizer


@dataclass(frozen=True)
class Delta:
    """New text and token ids since the previous Delta."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Summary:
    """The end of a completion: why it stopped and what it used."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None when no token came
    e2e_s: float


class Completion:
    def __init__(self, tokenizer, prompt_ids: list[int], stops, received_s: float) -> None:
        self._dedup = IndexDedup()
        self._detok = IncrementalDetokenizer(tokenizer)
        self._cutter = StopCutter(stops)
        self._received_s = received_s
        self._prompt_tokens = len(prompt_ids)
        self._first_s: float | None = None
        self._last_s = received_s
        self.sent = 0
        self.done = False
        self.final_seen = False
        self._reason = "stop"

    def take(self, chunks: list[OutputChunk]) -> tuple[Delta | None, GatewayError | None]:
        """One Delta for a batch of output chunks (None when they only repeated sent tokens
        or held text back), and the error a chunk ended the request with, if one did: the
        Delta still carries the tokens before it."""
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
        return Delta(text=text, token_ids=new), failure

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
            self._reason = "length" if chunk.finish_reason == "length" else "stop"
        if self._cutter.stopped:
            self.done = True
            self._reason = "stop"
        return new, text

    def summary(self) -> Summary:
        now = time.perf_counter()
        ttft_s = (self._first_s - self._received_s) if self._first_s is not None else None
        e2e_s = now - self._received_s
        m.observe_request_done(self._reason, self._prompt_tokens, self.sent, ttft_s, e2e_s, None)
        return Summary(self._reason, self._prompt_tokens, self.sent, ttft_s, e2e_s)
