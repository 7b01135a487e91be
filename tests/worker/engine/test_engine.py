"""The engine against transformers: greedy identity (near-tie rule in tests/conftest.py), stop
conditions, aborts, seeded sampling and parameter validation — on the shipped pair when it
exists, else on the random Llama checkpoints."""

from __future__ import annotations

import pytest

from nightjar.messages import SamplingParams
from tests.conftest import check_greedy, engine, hf_greedy, pair, prompt_ids, run_all, tokenizer
from worker.engine.engine import EngineRequest

N_TOKENS = 24


def _eng():
    return engine(pair()[0])


def _reqs(prompts, lens=None, **params):
    return [EngineRequest(f"r{i}", list(p), SamplingParams(max_tokens=(lens[i] if lens else N_TOKENS), **params))
            for i, p in enumerate(prompts)]


def test_greedy_one_at_a_time_matches_transformers():
    target = pair()[0]
    eng = _eng()
    for i, p in enumerate(prompt_ids(target, 20)):
        got = run_all(eng, _reqs([p]))["r0"]
        err = check_greedy(hf_greedy(target, p, N_TOKENS), got)
        assert err is None, f"prompt {i}: {err}"
    assert eng.kv_blocks_free == eng.kv_blocks_total


def test_greedy_16_staggered_concurrent_matches_transformers():
    target = pair()[0]
    eng = _eng()
    prompts = prompt_ids(target, 20)[4:20]
    lens = [8 + (i * 5) % 17 for i in range(16)]  # mixed output lengths 8..24
    out = run_all(eng, _reqs(prompts, lens), arrive_every=2)
    for i, p in enumerate(prompts):
        ref_toks, top2 = hf_greedy(target, p, N_TOKENS)
        err = check_greedy((ref_toks[: lens[i]], top2), out[f"r{i}"])
        assert err is None, f"request {i}: {err}"
    assert eng.kv_blocks_free == eng.kv_blocks_total


def test_max_tokens_stops_with_length():
    eng = _eng()
    p = prompt_ids(pair()[0], 1)[0]
    out = run_all(eng, _reqs([p], [5], ignore_eos=True))
    assert len(out["r0"]) == 5 and run_all.reasons["r0"] == "length"


def test_stop_string_cuts_at_the_completing_token():
    target = pair()[0]
    eng = _eng()
    p = prompt_ids(target, 3)[2]
    full = run_all(eng, _reqs([p], ignore_eos=True))["r0"]
    tok = tokenizer(target)
    text = tok.decode(full[:12], skip_special_tokens=True)
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    first = next(k for k in range(1, 13) if stop in tok.decode(full[:k], skip_special_tokens=True))
    out = run_all(eng, _reqs([p], stop=(stop,), ignore_eos=True))["r0"]
    assert run_all.reasons["r0"] == "stop"
    assert out == full[:first]


def test_eos_stops_without_emitting_it():
    eng = _eng()
    p = prompt_ids(pair()[0], 2)[1]
    full = run_all(eng, _reqs([p], ignore_eos=True))["r0"]
    eos_before = set(eng.eos_ids)
    eng.eos_ids.add(full[5])  # pretend the 6th token is an EOS
    try:
        out = run_all(eng, _reqs([p]))["r0"]
        reason = run_all.reasons["r0"]
        ignored = run_all(eng, _reqs([p], ignore_eos=True))["r0"]
    finally:
        eng.eos_ids.clear()
        eng.eos_ids.update(eos_before)
    cut = full.index(full[5])
    assert out == full[:cut] and reason == "stop"
    assert ignored == full


def test_abort_frees_blocks_and_reports_abort():
    eng = _eng()
    prompts = prompt_ids(pair()[0], 4)
    for r in _reqs(prompts, ignore_eos=True):
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    eng.abort("r1")
    eng.abort("unknown-id")  # ignored
    seen = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                seen[o.request_id] = o.finish_reason
    assert seen["r1"] == "abort" and seen["r0"] == "length"
    assert eng.kv_blocks_free == eng.kv_blocks_total and eng.num_running == 0 and eng.num_waiting == 0


def test_seeded_sampling_is_reproducible_and_batch_independent():
    eng = _eng()
    prompts = prompt_ids(pair()[0], 6)
    params = dict(temperature=0.9, top_p=0.95, top_k=40, ignore_eos=True)
    alone = run_all(eng, [EngineRequest("a", list(prompts[0]), SamplingParams(max_tokens=16, seed=7, **params))])["a"]
    crowd = [EngineRequest("a", list(prompts[0]), SamplingParams(max_tokens=16, seed=7, **params))]
    crowd += [EngineRequest(f"o{i}", list(p), SamplingParams(max_tokens=12, seed=100 + i, **params))
              for i, p in enumerate(prompts[1:])]
    together = run_all(eng, crowd, arrive_every=1)["a"]
    other_seed = run_all(eng, [EngineRequest("a", list(prompts[0]), SamplingParams(max_tokens=16, seed=8, **params))])["a"]
    assert alone == together
    assert alone != other_seed


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("seed", -1), ("stop", ("",))])
def test_invalid_params_raise_naming_the_field(field, value):
    eng = _eng()
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        eng.add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(**{field: value})))
    assert not eng.has_unfinished()


def test_invalid_prompts_raise():
    eng = _eng()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request(EngineRequest("x", [], SamplingParams()))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request(EngineRequest("x", [10**9], SamplingParams()))
    with pytest.raises(ValueError, match="context"):
        eng.add_request(EngineRequest("x", [1] * eng.max_context_tokens, SamplingParams()))
    assert not eng.has_unfinished()
