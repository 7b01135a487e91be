"""BlockManager accounting (unit) and the engine's block lifecycle under pressure (real model)."""

from __future__ import annotations

from nightjar.messages import SamplingParams
from tests.conftest import check_greedy, engine, hf_greedy, pair, prompt_ids, run_all
from worker.engine.block_manager import BlockManager
from worker.engine.engine import EngineRequest
from worker.engine.runner import ModelRunner


def test_ensure_trim_free_account_every_block():
    bm = BlockManager(10, 4, watermark=0.1)
    a, b = [], []
    assert bm.ensure(a, 9) and len(a) == 3  # ceil(9 / 4)
    assert bm.ensure(b, 16) and len(b) == 4
    assert bm.num_free == 3 and not set(a) & set(b)
    assert not bm.ensure(a, 9 + 17) and len(a) == 3  # needs 4 more, 3 free: all or nothing
    bm.trim(b, 5)
    assert len(b) == 2 and bm.num_free == 5
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 10 and a == [] and b == []


def test_admission_keeps_the_watermark_free():
    bm = BlockManager(100, 4, watermark=0.05)
    t: list[int] = []
    assert bm.can_admit(t, 95 * 4)
    assert not bm.can_admit(t, 96 * 4)  # would eat into the 5 watermark blocks


def test_shrink_plan_moves_live_blocks_down():
    bm = BlockManager(8, 2, watermark=0.0)
    tables = [[], []]
    bm.ensure(tables[0], 6)  # blocks 0, 1, 2
    bm.ensure(tables[1], 6)  # blocks 3, 4, 5
    bm.free(tables[0])
    moves = bm.plan_shrink(4, tables)
    assert moves is not None and set(moves) == {4, 5}
    bm.apply_shrink(4, moves, tables)
    assert all(b < 4 for b in tables[1]) and bm.num_free == 1 and bm.num_blocks == 4
    assert bm.plan_shrink(2, tables) is None  # three live blocks cannot fit in two


def test_preemption_under_tiny_budget_keeps_greedy_output():
    target = pair()[0]
    probe = engine(target)
    bpb = ModelRunner.bytes_per_block(probe.runner.model, 8)
    # 16 blocks of 8 tokens: six requests of ~40 prompt + 24 new tokens need ~8 blocks each
    eng = engine(target, block_size=8, kv_budget_bytes=16 * bpb, max_running=6, max_batched_tokens=64, gamma_max=2)
    prompts = [p[:40] for p in prompt_ids(target, 26)[20:26]]
    seen = {}  # step number -> its stats (on_step sees the step before; the last one is read after)
    out = run_all(eng, [EngineRequest(f"r{i}", list(p), SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)],
                  on_step=lambda e, s: seen.update({e.last_stats.step: e.last_stats}) if e.last_stats else None)
    seen[eng.last_stats.step] = eng.last_stats
    steps = list(seen.values())
    assert len(steps) == eng.last_stats.step
    preempted = sum(s.preempted for s in steps)
    assert preempted > 0, "the budget was meant to force preemption"
    # What was prefilled beyond the prompts is the recompute: the KV each preemption freed, plus
    # at most one token per victim (a decoding victim's last token is fed by its new prefill).
    recomputed = sum(s.prefill_tokens for s in steps) - sum(map(len, prompts))
    freed = sum(s.preempted_tokens for s in steps)
    assert freed > 0 and freed <= recomputed <= freed + preempted
    for i, p in enumerate(prompts):
        err = check_greedy(hf_greedy(target, p, 24), out[f"r{i}"])
        assert err is None, f"request {i}: {err}"
    assert eng.kv_blocks_free == eng.kv_blocks_total
