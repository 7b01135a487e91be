"""The acceptance rule (worker/engine/rejection.py) is lossless: output is distributed as the target's.

1. A pair of first-order Markov "models" over 4 tokens (the first 3 tokens' law known in closed
   form), the real rule vectorised over 200k streams, chi-square fit; a broken rule (residual = p
   instead of max(0, p - q), or accepting everything) must fail the same test.
2. On greedy rows the rule is the greedy fast path.
3. The engine on the real pair (slow): 2 tokens at γ = 3, temperature and top-k, many seeds,
   against the target's exact distribution computed with transformers.
"""

from __future__ import annotations

import pytest
import torch

from nightjar.messages import SamplingParams
from tests.conftest import engine, hf_model, pair, prompt_ids, run_all
from worker.engine.engine import EngineRequest
from worker.engine.rejection import accept, accept_greedy, accept_tokens
from worker.engine.sampler import RowParams, probs_from_logits, sample

P_MIN = 1e-4  # reject "same distribution" below this chi-square p-value


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome was produced"
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def _broken_residual(p, q, drafts, u_accept, u_final):
    n, _ = accept_tokens(p, q, drafts, u_accept, u_final)
    return n, sample(p[torch.arange(p.shape[0]), n], u_final)  # residual = p: the classic bug


def _accept_all(p, q, drafts, u_accept, u_final):
    return accept_tokens(p, q, drafts, torch.zeros_like(u_accept), u_final)


def _markov_pair(v: int = 4):
    g = torch.Generator().manual_seed(11)
    pm = torch.rand(v, v, generator=g) ** 2
    qm = torch.rand(v, v, generator=g) ** 2
    pm[:, 3] = 0.0  # the target never says 3, the draft does: those must all be rejected
    qm[:, 1] = 0.0  # the draft never says 1: only the residual can produce it
    return pm / pm.sum(1, keepdim=True), qm / qm.sum(1, keepdim=True)  # [V, V] next | last


def simulate(rule, gamma: int, streams: int = 200_000, length: int = 3, seed: int = 0) -> torch.Tensor:
    """First ``length`` tokens of ``streams`` speculative streams -> [streams, length]."""
    pm, qm = _markov_pair()
    g = torch.Generator().manual_seed(seed)
    state = torch.zeros(streams, dtype=torch.long)
    out = torch.full((streams, length), -1, dtype=torch.long)
    ptr = torch.zeros(streams, dtype=torch.long)
    rows = torch.arange(streams)
    while bool((ptr < length).any()):
        cur, drafts, qs = state, [], []
        for _ in range(gamma):
            q = qm[cur]  # [R, V]
            cur = sample(q, torch.rand(streams, generator=g))
            drafts.append(cur)
            qs.append(q)
        d = torch.stack(drafts, 1)  # [R, γ]
        p = pm[torch.cat([state.unsqueeze(1), d], 1)]  # [R, γ+1, V]: p at every verified position
        n, final = rule(p, torch.stack(qs, 1), d, torch.rand(streams, gamma, generator=g),
                        torch.rand(streams, generator=g))
        emitted = torch.cat([d, torch.zeros(streams, 1, dtype=torch.long)], 1)
        emitted[rows, n] = final  # [R, γ+1]: x_1..x_n, then the corrected / bonus token
        for k in range(gamma + 1):
            w = (k <= n) & (ptr + k < length)
            out[rows[w], (ptr + k)[w]] = emitted[w, k]
        ptr += n + 1
        state = final
    return out


def exact_probs(length: int = 3) -> torch.Tensor:
    """[V ** length] closed-form probabilities, index t1 * V^(L-1) + ... + tL (as _counts)."""
    pm, _ = _markov_pair()
    v = pm.shape[0]
    probs = pm[0]  # streams start in state 0
    for _ in range(length - 1):
        # a sequence with index i ends in token i % V; extend it by every next token
        probs = (probs.unsqueeze(1) * pm[torch.arange(probs.numel()) % v]).reshape(-1)
    return probs


def _counts(out: torch.Tensor, v: int = 4) -> torch.Tensor:
    idx = torch.zeros(out.shape[0], dtype=torch.long)
    for k in range(out.shape[1]):
        idx = idx * v + out[:, k]
    return torch.bincount(idx, minlength=v ** out.shape[1]).double()


@pytest.mark.parametrize("gamma", [1, 3])
def test_acceptance_rule_reproduces_the_target_distribution(gamma):
    p_value = chi2_pvalue(_counts(simulate(accept_tokens, gamma)), exact_probs())
    assert p_value > P_MIN, f"γ={gamma}: speculative stream differs from the target (p={p_value:.2e})"


@pytest.mark.parametrize("rule", [_broken_residual, _accept_all])
def test_a_broken_acceptance_rule_fails_the_same_test(rule):
    try:
        p_value = chi2_pvalue(_counts(simulate(rule, 3)), exact_probs())
    except AssertionError:  # produced an impossible token: failed even harder
        return
    assert p_value < P_MIN, f"{rule.__name__} went unnoticed (p={p_value:.2e})"


def test_greedy_fast_path_is_the_general_rule_on_one_hot_rows():
    """On greedy rows p and q are one-hot, and the rejection rule becomes "longest prefix
    matching the target's argmax, then the target's token": accept_greedy, whatever the uniforms."""
    g = torch.Generator().manual_seed(3)
    b, gamma, v = 256, 4, 5
    logits = torch.randn(b, gamma + 1, v, generator=g)  # [B, γ+1, V] the target's
    top = logits.argmax(-1)  # [B, γ+1]
    guess = torch.randint(0, v, (b, gamma), generator=g)
    drafts = torch.where(torch.rand(b, gamma, generator=g) < 0.7, top[:, :gamma], guess)  # [B, γ]
    p = torch.zeros(b, gamma + 1, v).scatter_(2, top.unsqueeze(2), 1.0)
    q = torch.zeros(b, gamma, v).scatter_(2, drafts.unsqueeze(2), 1.0)
    u_accept, u_final = torch.rand(b, gamma, generator=g), torch.rand(b, generator=g)
    n, nxt = accept_greedy(top, drafts)
    assert 0 < int(n.sum()) and int((n == gamma).sum()) > 0 and int((n == 0).sum()) > 0  # every case met
    n2, nxt2 = accept_tokens(p, q, drafts, u_accept, u_final)
    assert torch.equal(n, n2) and torch.equal(nxt, nxt2)
    params = [SamplingParams(temperature=0.0)] * b  # what the engine calls: the greedy path, no q needed
    n3, nxt3 = accept(logits, drafts, None, RowParams.of(params), params, u_accept, u_final)
    assert torch.equal(n, n3) and torch.equal(nxt, nxt3)


@pytest.mark.slow
def test_engine_sampling_with_speculation_matches_the_target():
    target, draft = pair()
    eng = engine(target, draft)
    prompt = list(prompt_ids(target, 3)[2][:8])  # short: 400 prefills must stay cheap
    params = dict(temperature=0.8, top_k=3, max_tokens=2, ignore_eos=True)
    rp = RowParams.of([SamplingParams(**params)])
    model = hf_model(target)
    with torch.inference_mode():
        p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1:].float(), rp)[0]  # [V]
        firsts = p1.nonzero().flatten().tolist()
        p2 = {t: probs_from_logits(model(torch.tensor([prompt + [t]])).logits[0, -1:].float(), rp)[0] for t in firsts}
    cells = [(a, b) for a in firsts for b in p2[a].nonzero().flatten().tolist()]
    exact = torch.tensor([float(p1[a] * p2[a][b]) for a, b in cells], dtype=torch.float64)
    eng.set_gamma_policy(lambda b: 3)
    try:
        reqs = [EngineRequest(f"s{i}", prompt, SamplingParams(seed=1000 + i, **params)) for i in range(400)]
        out = run_all(eng, reqs)
    finally:
        eng.set_gamma_policy(lambda b: 0)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for toks in out.values():
        counts[index[tuple(toks)]] += 1  # KeyError = an impossible pair was sampled
    p_value = chi2_pvalue(counts, exact)
    assert p_value > P_MIN, f"engine's speculative samples differ from the target (p={p_value:.2e})"
