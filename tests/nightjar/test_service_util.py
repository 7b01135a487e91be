"""stop_tasks: a service's shutdown waits for its loops, but not for one that swallows its cancel."""

from __future__ import annotations

import asyncio
import logging
import time

from nightjar.service_util import stop_tasks


async def test_stop_tasks_cancels_the_loops_and_leaves_one_that_ignores_its_cancel(caplog):
    async def loop():
        await asyncio.sleep(3600)

    release = asyncio.Event()

    async def stubborn():  # what a cancel swallowed inside a Redis call looks like from outside
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    async def failed():
        raise ValueError("boom")

    tasks = [asyncio.create_task(loop(), name="inbox"), asyncio.create_task(stubborn(), name="heartbeat"),
             asyncio.create_task(failed(), name="reader")]
    await asyncio.sleep(0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await stop_tasks(tasks, logging.getLogger("test"), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert tasks[0].cancelled() and not tasks[1].done() and isinstance(tasks[2].exception(), ValueError)
    assert "heartbeat did not stop" in caplog.text and "inbox" not in caplog.text
    release.set()
    await tasks[1]
