"""Speculation's acceptance rule: how many draft tokens the target keeps, and the token after them.

``accept`` is what the engine calls after the target's verify pass: when every row is greedy,
``accept_greedy`` (the longest prefix matching the target's argmax, then the target's token);
otherwise ``accept_tokens``, rejection sampling (Leviathan et al.), which keeps the output
distributed exactly as the target's. Change the rule here; drafting the tokens is proposer.py.
"""

from __future__ import annotations

import torch

from nightjar.messages import SamplingParams
from worker.engine.sampler import RowParams, probs_from_logits, sample


def accept(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, rp: RowParams,
           params: list[SamplingParams], u_accept: torch.Tensor, u_final: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, γ+1, V] the target's at the verified positions, drafts: [B, γ], q: [B, γ, V] or
    None (every row greedy), rp: one row per sequence, params: each sequence's settings,
    u_accept: [B, γ], u_final: [B] uniforms -> (n_accepted [B], next token [B])."""
    if rp.all_greedy:
        return accept_greedy(logits.argmax(-1), drafts)
    b, g1, _ = logits.shape
    rows = RowParams.of(params, g1).to(logits.device)  # one row per position: p after the same filters as q
    p = probs_from_logits(logits.reshape(b * g1, -1), rows)  # [B * (γ+1), V]
    return accept_tokens(p.view(b, g1, -1), q, drafts, u_accept, u_final)


def accept_tokens(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                  u_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p: [B, γ+1, V] target probs, q: [B, γ, V] draft probs, drafts: [B, γ] draft tokens,
    u_accept: [B, γ], u_final: [B] uniforms -> (n_accepted [B], next token [B]).

    Acceptance (Leviathan et al. / gpt-fast), per sequence, with p the target's and q the draft's
    distributions after temperature / top-k / top-p (applied identically to both):
        accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)), stop at the first reject;
        on a reject at i sample from the residual norm(max(0, p_i - q_i));
        if all γ are accepted sample the bonus token from p_γ.
    Greedy rows carry one-hot p and q, which turns this into "longest prefix matching the target's
    argmax, then the target's token".
    """
    b, g1, v = p.shape
    gamma = g1 - 1
    rows = torch.arange(b, device=p.device)
    if gamma > 0:
        px = p[:, :gamma].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, γ] p_i(x_i)
        qx = q.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, γ] q_i(x_i) > 0: x_i was drawn from q_i
        ok = u_accept * qx < px  # u < p/q  <=>  accepted with probability min(1, p/q)
        n = ok.long().cumprod(1).sum(1)  # [B] length of the accepted prefix
        q_ext = torch.cat([q, torch.zeros(b, 1, v, dtype=q.dtype, device=q.device)], 1)  # [B, γ+1, V], q_γ := 0
        resid = (p[rows, n] - q_ext[rows, n]).clamp_min(0.0)  # [B, V]; = p_γ when all accepted
        # p == q exactly leaves no residual mass, but then nothing could be rejected there
        resid = torch.where(resid.sum(1, keepdim=True) > 0, resid, p[rows, n])
    else:
        n = torch.zeros(b, dtype=torch.long, device=p.device)
        resid = p[:, 0]
    return n, sample(resid, u_final)


def accept_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast path when every row is greedy. target_argmax: [B, γ+1], drafts: [B, γ]."""
    gamma = drafts.shape[1]
    n = (drafts == target_argmax[:, :gamma]).long().cumprod(1).sum(1)  # [B]
    return n, target_argmax.gather(1, n.unsqueeze(1)).squeeze(1)
