"""Sampling transforms, inverse-CDF draws and the incremental detokenizer (pure logic)."""

from __future__ import annotations

import torch

from nightjar.messages import SamplingParams
from nightjar.text import IncrementalDetokenizer
from tests.conftest import pair, tokenizer
from worker.engine.sampler import RowParams, draw_uniforms, probs_from_logits, sample


def test_top_k_top_p_temperature_and_greedy_rows():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    rp = RowParams.of([SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7),
                       SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    p = probs_from_logits(logits, rp)
    torch.testing.assert_close(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(p[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 < 0.7, 0.8 >= 0.7: stop
    torch.testing.assert_close(p[2], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(p[3], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    hot = probs_from_logits(logits[:1], RowParams.of([SamplingParams(temperature=0.5)]))
    torch.testing.assert_close(hot[0], torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2 / (0.25 + 0.09 + 0.0225 + 0.0025))


def test_inverse_cdf_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 5)
    u = torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.999999])
    assert sample(probs, u).tolist() == [1, 1, 1, 3, 3]
    freq = torch.bincount(sample(torch.tensor([[0.2, 0.8]]).expand(20000, 2), torch.rand(20000)), minlength=2)
    assert abs(freq[1].item() / 20000 - 0.8) < 0.02


def test_uniforms_come_from_each_requests_generator():
    a = draw_uniforms([torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], 3)
    b = draw_uniforms([torch.Generator().manual_seed(2)], 3)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])


def test_detokenizer_never_splits_a_utf8_character():
    tok = tokenizer(pair()[0])
    text = "naïve café — 日本語 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1], "no token split a character: the hold-back path was not exercised"
