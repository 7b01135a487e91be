"""Speculative decoding on the real pair: greedy identity for every γ and for γ changing each
step (with catch-ups), exact stops inside accepted runs, no leaked or stale KV, the alarm."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from nightjar.messages import SamplingParams
from tests.conftest import check_greedy, engine, hf_greedy, pair, prompt_ids, run_all, tokenizer
from worker.engine.acceptance import AcceptanceMonitor
from worker.engine.engine import EngineRequest
from worker.engine.linear import can_bf16

N_TOKENS = 24
POISON = 1.0e4  # finite: a masked key/value must contribute exactly 0, a read one shows at once


def _spec_engine(**kw):
    target, draft = pair()
    return engine(target, draft, **kw)


def _reqs(prompts, n=N_TOKENS, **params):
    return [EngineRequest(f"r{i}", list(p), SamplingParams(max_tokens=n, **params)) for i, p in enumerate(prompts)]


def _poison_unused_kv(eng) -> None:
    """Overwrite every KV slot no sequence may read (free blocks, slots past num_computed /
    draft_computed), so that reading stale KV would change the output."""
    for runner, attr, table_attr in ((eng.runner, "num_computed", "block_table"),
                                     (eng.proposer.runner, "draft_computed", "draft_table")):
        bs = runner.block_size
        live = torch.zeros(runner.kv.num_blocks, bs, dtype=torch.bool)
        for s in eng.scheduler.running:
            table, n = getattr(s, table_attr), getattr(s, attr)
            for pos in range(n):
                live[table[pos // bs], pos % bs] = True
        dead = ~live  # [num_blocks, block_size]
        runner.kv.k[:, dead] = POISON
        runner.kv.v[:, dead] = -POISON


def _check_invariants(eng) -> None:
    for s in eng.scheduler.running:
        assert s.draft_computed <= s.num_tokens - 1
        if not s.is_prefill:
            assert s.num_computed == s.num_tokens - 1
            assert len(s.block_table) <= eng.runner.blocks.blocks_for(s.num_tokens)  # lookahead given back


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6])
def test_greedy_speculation_is_token_identical_for_every_gamma(gamma):
    target, _ = pair()
    eng = _spec_engine()
    eng.set_gamma_policy(lambda b: gamma)
    prompts = prompt_ids(target, 20)[4:20]
    steps = []
    out = run_all(eng, _reqs(prompts), arrive_every=2, on_step=lambda e, s: steps.append(e.last_stats))
    eng.set_gamma_policy(lambda b: 0)
    assert any(st is not None and st.gamma == gamma for st in steps)
    for i, p in enumerate(prompts):
        err = check_greedy(hf_greedy(target, p, N_TOKENS), out[f"r{i}"])
        assert err is None, f"γ={gamma} request {i}: {err}"
    assert eng.kv_blocks_free == eng.kv_blocks_total
    assert eng.proposer.runner.blocks.num_free == eng.proposer.runner.blocks.num_blocks


def test_gamma_changing_every_step_with_catchups_and_poisoned_stale_kv():
    target, _ = pair()
    eng = _spec_engine()
    rng = random.Random(5)
    eng.set_gamma_policy(lambda b: rng.choice([0, 0, 1, 2, 3, 4, 5, 6]))
    prompts = prompt_ids(target, 20)[4:20]
    stats = []

    def each_step(e, s):
        _check_invariants(e)
        _poison_unused_kv(e)
        stats.append(e.last_stats)

    out = run_all(eng, _reqs(prompts), arrive_every=2, on_step=each_step)
    eng.set_gamma_policy(lambda b: 0)
    for i, p in enumerate(prompts):
        err = check_greedy(hf_greedy(target, p, N_TOKENS), out[f"r{i}"])
        assert err is None, f"request {i}: {err}"
    catchups = [st for st in stats if st is not None and st.catchup_tokens > 0]
    assert catchups and all(st.catchup_ms > 0 for st in catchups)
    assert {st.gamma for st in stats if st is not None} >= {0, 3, 6}
    assert eng.kv_blocks_free == eng.kv_blocks_total
    assert eng.proposer.runner.blocks.num_free == eng.proposer.runner.blocks.num_blocks


def test_catchup_after_gamma_zero_rebuilds_exactly_the_missed_tokens():
    eng = _spec_engine()
    target, _ = pair()
    prompts = prompt_ids(target, 4)
    eng.set_gamma_policy(lambda b: 0)
    for r in _reqs(prompts, ignore_eos=True):
        eng.add_request(r)
    for _ in range(6):
        eng.step()
    seqs = list(eng.scheduler.running)
    missed = sum(s.num_tokens - 1 - s.draft_computed for s in seqs)
    lag_two = sum(1 for s in seqs if s.num_tokens - 1 - s.draft_computed > 1)
    eng.set_gamma_policy(lambda b: 3)
    eng.step()
    st = eng.last_stats
    eng.set_gamma_policy(lambda b: 0)
    while eng.has_unfinished():
        eng.step()
    assert st.gamma == 3 and st.catchup_ms > 0 and lag_two == len(seqs)
    assert st.catchup_tokens == missed  # everything but the last token, which the proposal feeds


@pytest.mark.parametrize("stop_kind", ["max_tokens", "stop_string", "eos"])
def test_stop_inside_an_accepted_run_cuts_where_plain_decoding_does(stop_kind):
    target, _ = pair()
    eng = _spec_engine()
    prompts = prompt_ids(target, 8)
    eng.set_gamma_policy(lambda b: 0)
    full = run_all(eng, _reqs(prompts, ignore_eos=True))
    tok = tokenizer(target)
    eos_before = set(eng.eos_ids)
    params: list[dict] = []
    for i in range(len(prompts)):
        if stop_kind == "max_tokens":
            params.append(dict(max_tokens=5 + i, ignore_eos=True))
        elif stop_kind == "stop_string":
            text = tok.decode(full[f"r{i}"][:9 + i], skip_special_tokens=True)
            params.append(dict(stop=(text[-2:],), ignore_eos=True))
        else:
            eng.eos_ids.add(full[f"r{i}"][6 + i])
            params.append({})
    try:
        results = {}
        for gamma in (0, 4, 6):
            eng.set_gamma_policy(lambda b, g=gamma: g)
            reqs = [EngineRequest(f"r{i}", list(p), SamplingParams(**{"max_tokens": N_TOKENS, **params[i]}))
                    for i, p in enumerate(prompts)]
            results[gamma] = (run_all(eng, reqs), dict(run_all.reasons))
    finally:
        eng.set_gamma_policy(lambda b: 0)
        eng.eos_ids.clear()
        eng.eos_ids.update(eos_before)
    plain, plain_reasons = results[0]
    assert all(r == ("length" if stop_kind == "max_tokens" else "stop") for r in plain_reasons.values())
    for gamma in (4, 6):
        assert results[gamma] == (plain, plain_reasons), f"γ={gamma} cut differently"


def test_acceptance_monitor_alarms_only_after_healthy_then_collapse(caplog):
    m = AcceptanceMonitor(window=4, floor=0.05, healthy=0.3)
    assert not any(m.observe(3, 2, 0) for _ in range(8))  # never healthy: no alarm (a weak draft, not a broken one)
    for _ in range(4):
        m.observe(3, 2, 4)  # rate 4/6
    with caplog.at_level(logging.WARNING, logger="nightjar.engine"):
        flags = [m.observe(3, 2, 0) for _ in range(4)]
    assert flags == [False, False, False, True] and "collapsed" in caplog.text
    assert m.observe(0, 2, 0) is True  # γ = 0 steps neither clear nor feed it
    for _ in range(4):
        m.observe(3, 2, 5)
    assert not m.alarm


def test_broken_draft_raises_the_alarm_in_stats():
    target, draft = pair()
    eng = engine(target, draft, acceptance_alarm_window=6)
    eng.set_gamma_policy(lambda b: 3)
    prompts = prompt_ids(target, 4)
    head = eng.proposer.runner.model.w["head"]
    saved = head.clone()
    seen = []
    try:
        run_all(eng, _reqs(prompts, n=40, ignore_eos=True), on_step=lambda e, s: seen.append(e.last_stats))
        # The alarm needs a healthy window first; the shipped pair gives one on these prompts
        # (the last window alone can be weak: text after an ignored EOS is hard to draft).
        was_healthy = eng.monitor.seen_healthy
        head.zero_()  # the "draft" now always proposes token 0: acceptance collapses
        run_all(eng, _reqs(prompts, n=60, ignore_eos=True), on_step=lambda e, s: seen.append(e.last_stats))
    finally:
        head.copy_(saved)
        eng.set_gamma_policy(lambda b: 0)
    assert was_healthy, "the shipped draft never reached a healthy acceptance window on these prompts"
    assert eng.last_stats.acceptance_alarm and eng.monitor.last_rate < 0.05
    eng.monitor.alarm = False
    eng.monitor.seen_healthy = False


def test_table_policy_picks_the_bucket_at_or_below_the_batch_size():
    from worker.engine.proposer import table_policy

    pol = table_policy({4: 2, 1: 4, 16: 0})
    assert [pol(b) for b in (1, 2, 4, 15, 16, 64)] == [4, 4, 2, 2, 0, 0]
    with pytest.raises(ValueError):
        table_policy({})


def test_gamma_zero_runs_no_draft_work_at_all():
    target, _ = pair()
    eng = _spec_engine()
    runner = eng.proposer.runner

    def forbidden(runs):
        raise AssertionError("the draft ran a forward while γ = 0")

    runner.forward = forbidden  # shadows the method on this instance only
    try:
        eng.set_gamma_policy(lambda b: 0)
        out = run_all(eng, _reqs(prompt_ids(target, 4), n=8))
    finally:
        del runner.forward
    assert all(len(v) > 0 for v in out.values())
    assert runner.blocks.num_free == runner.blocks.num_blocks  # no draft slots reserved either


@pytest.mark.skipif(not can_bf16(), reason="oneDNN has no native bf16 path on this CPU")
def test_speculation_stays_lossless_with_bf16_prefill():
    """bf16 prefill moves the prompt's KV off transformers' fp32, so the reference is the same
    engine at γ = 0: speculation must not change a greedy token on top of it."""
    target, _ = pair()
    eng = _spec_engine(prefill_dtype="bfloat16")
    prompts = prompt_ids(target, 20)[4:16]
    outs = {}
    for gamma in (0, 3):
        eng.set_gamma_policy(lambda b, g=gamma: g)
        outs[gamma] = run_all(eng, _reqs(prompts))  # all at once: every prompt in one prompt-only step
    eng.set_gamma_policy(lambda b: 0)
    assert outs[3] == outs[0]
    assert all(len(v) == N_TOKENS for v in outs[0].values())
