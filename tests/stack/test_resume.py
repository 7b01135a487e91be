"""A re-dispatched sampled request continues the completion its client already has.

Before, the new worker ran the request again from index 0 and the gateway dropped the indices
the client had: with temperature > 0 the client got tokens 0..n-1 of one sample and n.. of
another, a spliced completion that neither worker would ever produce. Now the new worker reads
what the request's output stream delivered, prefills prompt + those tokens and continues at
index n (greedy output stays identical to an uninterrupted run: tests/stack/test_pipeline.py and
tests/worker/service/test_worker_service.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import zlib

import pytest

from nightjar.v1 import inference_pb2 as pb
from tests.stack.conftest import aio_stub, busiest_worker, prompt_texts, start_stack

STREAMS = 32
MAX_TOKENS = 64
KILL_AFTER = 8  # tokens per stream
RESUMED = re.compile(r"resuming request \S+ at index (\d+) \(prefix crc32 ([0-9a-f]{8})\)")


@pytest.mark.slow
async def test_sigkill_mid_sample_each_client_gets_one_continuation():
    stack = start_stack(workers=2, policy="fixed:3")
    try:
        texts = prompt_texts(STREAMS, chars=80)
        counts = [0] * STREAMS
        enough = asyncio.Event()

        async def stream(stub, i):
            toks = []
            request = pb.GenerateRequest(prompt=texts[i], max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
            async for resp in stub.Generate(request):
                toks += resp.token_ids
                counts[i] = len(toks)
                if min(counts) >= KILL_AFTER:
                    enough.set()
            return toks

        channel, stub = aio_stub(stack)
        async with channel:
            tasks = [asyncio.create_task(stream(stub, i)) for i in range(STREAMS)]
            await asyncio.wait_for(enough.wait(), 120)
            victim, held = busiest_worker(stack)
            assert held > 0
            os.kill(victim.proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert all(len(toks) == MAX_TOKENS for toks in results)
        heir = next(s for s in stack.workers() if s is not victim)
        resumed = [(int(n), crc) for n, crc in RESUMED.findall(heir.log_path.read_text())]
        # Every job the heir took over was given exactly the prefix one client holds, so that
        # client's tokens from there on are the heir's continuation of its own prefix.
        assert len(resumed) >= max(1, held // 2), (held, resumed)
        matched = set()
        for n, crc in resumed:
            hits = [i for i, toks in enumerate(results) if f"{zlib.crc32(repr(list(toks[:n])).encode()):08x}" == crc]
            assert len(hits) == 1, (n, crc, hits)
            matched.add(hits[0])
        assert len(matched) == len(resumed)
    finally:
        stack.stop()
