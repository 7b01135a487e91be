"""The serving-shaped pair through the real stack, and the cost surface measured with it."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from nightjar.paths import SERVE_DRAFT, SERVE_TARGET
from nightjar_tools.stack import Stack, StackConfig
from tests.conftest import check_greedy, hf_greedy, tokenizer
from tests.stack.conftest import aio_stub, generate, prompt_texts

SURFACES = Path(__file__).resolve().parents[2] / "planner_svc" / "cost_surfaces"


@pytest.mark.slow
async def test_greedy_through_the_stack_equals_transformers_generate(redis_url):
    cfg = StackConfig(port=0, workers=1, redis_url=redis_url, key_prefix=f"p{uuid.uuid4().hex[:8]}",
                      target_path=SERVE_TARGET, draft_path=SERVE_DRAFT, policy="fixed:3")
    stack = await asyncio.to_thread(lambda: Stack(cfg).start())
    try:
        channel, stub = aio_stub(stack)
        texts = prompt_texts(3, chars=160)
        async with channel:
            outs = await asyncio.gather(*(generate(stub, t, 24, ignore_eos=True) for t in texts))
        tok = tokenizer(str(SERVE_TARGET))
        for text, (got, _, last) in zip(texts, outs):
            assert len(got) == 24 and last.finish_reason
            problem = check_greedy(hf_greedy(str(SERVE_TARGET), tuple(tok.encode(text)), 24), got)
            assert problem is None, f"{text[:40]!r}: {problem}"
    finally:
        await asyncio.to_thread(stack.stop)


# Every shipped serve-pair surface, one per machine measured (AMD Zen 3, Intel, AMD Zen 4, ...).
@pytest.mark.parametrize("name", sorted(p.stem for p in SURFACES.glob("cpu_serve*.json")))
def test_surface_has_the_crossover_it_claims(name):
    # Read from the measured file (not timed here): the claimed crossover is where γ = 0 first
    # wins, or None when it never does; since the paged attention kernel it is batch 8-32
    # (BENCHMARKS.md). Speculation pays >= 1.7x at batch 1, the best γ falls from batch 1 to the
    # largest batch, and γ = 0 wins there.
    s = json.loads((SURFACES / f"{name}.json").read_text())
    tps, batches = s["tokens_per_s"], s["batch_sizes"]  # [B][γ] tokens/s
    best = [max(range(len(row)), key=row.__getitem__) for row in tps]
    first_zero = next((b for b, g in zip(batches, best) if g == 0), None)
    assert s["crossover_batch_size"] == first_zero
    assert max(tps[0]) >= 1.7 * tps[0][0] and best[0] >= 2
    assert best[-1] < best[0] and batches[-1] >= 64
    assert s["crossover_batch_size"] is not None and best[-1] == 0
