"""The transport-neutral request path shared by the gRPC servicer and the OpenAI HTTP front end.

Order matters: refuse before paying. The cheap checks (gateway open, field ranges, a byte cap
derived from the model's context) and admission (queue cap) come before tokenization, which
runs off the event loop on a small bounded pool (TGI's validation workers), so a burst of huge
prompts costs neither the running streams' inter-token gaps nor the health checks. Then
enqueue, stream, and cancel at the worker when the client leaves first.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from gateway.admission import AdmissionTable, InFlight
from gateway.completion import Completion, Delta, Summary
from gateway.config import GatewayConfig
from gateway.errors import DeadlineExceeded
from gateway.request_queue import RequestQueue
from gateway.validation import Limits, ValidRequest, check_length, prompt_byte_cap
from nightjar import metrics as m
from nightjar.messages import Job
from nightjar.service_util import now_ms
from nightjar.text import FastTokenizer

request_log = logging.getLogger("gateway.requests")


def log_finished(request_id: str, s: Summary) -> None:
    """One INFO line per finished request; with --log-format json its fields are the keys."""
    ttft = "-" if s.ttft_s is None else f"{s.ttft_s:.4f}"
    request_log.info(
        "request %s finished: %s, %d prompt + %d completion tokens, ttft %s s, e2e %.4f s",
        request_id, s.finish_reason, s.prompt_tokens, s.completion_tokens, ttft, s.e2e_s,
        extra={"request_id": request_id, "finish_reason": s.finish_reason, "prompt_tokens": s.prompt_tokens,
               "completion_tokens": s.completion_tokens, "ttft_s": s.ttft_s, "e2e_s": round(s.e2e_s, 6)})


class Inference:
    def __init__(self, cfg: GatewayConfig, tokenizer, queue: RequestQueue, table: AdmissionTable) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.fast = FastTokenizer(tokenizer)  # encode and the detokenizers' decodes, minus the wrappers
        self._queue = queue
        self._table = table
        context = cfg.max_context_tokens
        self.limits = Limits(cfg.default_max_tokens, cfg.max_tokens_limit, context,
                             max_prompt_bytes=prompt_byte_cap(tokenizer.get_vocab(), context))
        # Bounded: at most this many prompts tokenize at once; the rest wait their turn in the
        # pool's queue, whose length admission (max_queued) already caps.
        self._pool = ThreadPoolExecutor(max_workers=cfg.tokenizer_workers, thread_name_prefix="gateway-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    async def generate(self, request_id: str, valid: ValidRequest, remaining_s: float | None, *, chat: bool = False,
                       on_admit: Callable[[Callable[[], None]], None] | None = None) -> AsyncIterator[Delta | Summary]:
        """Deltas as tokens arrive, then one Summary. Raises gateway errors (before or between
        Deltas). ``on_admit`` receives the release function, for transports (gRPC) whose
        cancellation can skip this generator's ``finally``. A chat prompt already carries the
        template's special tokens, so none are added."""
        received_s = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + remaining_s if remaining_s is not None else None
        entry = await self._table.admit(request_id)  # queue cap and drain state, before any tokenizing
        if on_admit is not None:
            on_admit(lambda: self._release(entry))
        m.GATEWAY_QUEUED.set(self._table.queued)
        try:
            async with asyncio.timeout_at(deadline):
                prompt_ids = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self.fast.encode, valid.prompt, not chat)
                check_length(len(prompt_ids), valid.params.max_tokens, self.limits)
                entry.enqueued = True  # before the await: a cancel that lands during XADD must still be sent
                await self._queue.enqueue(Job(
                    request_id=request_id, prompt_token_ids=tuple(prompt_ids), params=valid.params.to_dict(),
                    # the budget left, not a time on this host's clock (workers judge it on theirs)
                    deadline_budget_ms=(max(1, int((deadline - asyncio.get_running_loop().time()) * 1000))
                                        if deadline is not None else 0),
                    enqueued_unix_ms=now_ms(),
                ))
                stream = Completion(self.fast, prompt_ids, valid.params.stop, received_s)
                async for delta in self._follow(entry, stream):
                    yield delta
        except TimeoutError:
            raise DeadlineExceeded(f"Deadline of {remaining_s:.3f}s passed before the request finished") from None
        finally:
            self._release(entry)
        summary = stream.summary()
        log_finished(request_id, summary)
        yield summary

    async def _follow(self, entry: InFlight, stream: Completion) -> AsyncIterator[Delta]:
        async for batch in self._queue.outputs(entry.request_id):
            delta, failure = stream.take(batch)
            if delta is not None:
                if entry.first_token_s is None and delta.token_ids:
                    self._table.first_token(entry)
                    m.GATEWAY_QUEUED.set(self._table.queued)
                yield delta
            if failure is not None:  # after the tokens that came before it
                raise failure
            if stream.done:
                break
        entry.finished = stream.final_seen

    def _release(self, entry: InFlight) -> None:
        """Release the request's admission slot once; cancel it at the worker unless it finished."""
        if not self._table.release(entry):
            return
        if not entry.enqueued:  # refused after admission (too long): nothing exists at a worker or in Redis
            pass
        elif entry.finished:
            self._queue.forget_soon(entry.request_id)
        else:  # client gone, deadline, stop string seen first, or an error: free the worker's blocks
            self._queue.cancel_soon(entry.request_id, "cancelled")
        m.GATEWAY_QUEUED.set(self._table.queued)
