"""Training loops: the target as a language model, the draft distilled from the target.

Both run on a token stream (documents joined by EOS) and sample random windows from it with a
seeded generator. The learning-rate schedule follows progress = max(steps done / planned steps,
time used / time budget), so a run on a busier machine still ends with a fully decayed rate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


@dataclass(frozen=True)
class TrainSpec:
    tokens: int  # planned training tokens
    minutes: float  # wall-time budget; whichever of the two ends first ends the run
    seq_len: int = 512
    batch: int = 8
    lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.05
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.minutes <= 0:
            raise ValueError("tokens and minutes must be positive")

    @property
    def planned_steps(self) -> int:
        return max(1, self.tokens // (self.seq_len * self.batch))


def sample_windows(stream: torch.Tensor, spec: TrainSpec, gen: torch.Generator) -> torch.Tensor:
    """stream: [n] token ids -> [batch, seq_len + 1] random windows."""
    starts = torch.randint(0, stream.numel() - spec.seq_len - 1, (spec.batch,), generator=gen)
    idx = starts[:, None] + torch.arange(spec.seq_len + 1)[None, :]  # [batch, seq_len + 1]
    return stream[idx].long()


def _lr(spec: TrainSpec, step: int, progress: float) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    return spec.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _run(model: LlamaForCausalLM, spec: TrainSpec, loss_fn: Callable[[torch.Tensor], torch.Tensor],
         stream: torch.Tensor, log: Callable[[str], None]) -> dict[str, float]:
    gen = torch.Generator().manual_seed(spec.seed)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    model.train()
    t0 = time.monotonic()
    step, seen, ema = 0, 0, float("nan")
    while True:
        elapsed = time.monotonic() - t0
        progress = max(step / spec.planned_steps, elapsed / (spec.minutes * 60))
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = _lr(spec, step, progress)
        batch = sample_windows(stream, spec, gen)  # [batch, seq_len + 1]
        loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += spec.batch * spec.seq_len
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            el = time.monotonic() - t0
            log(f"step {step} tokens {seen} loss {ema:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{seen / el:.0f} tok/s {el / 60:.1f} min")
    model.eval()
    return {"steps": step, "tokens": seen, "minutes": (time.monotonic() - t0) / 60, "train_loss": ema}


def train_lm(model: LlamaForCausalLM, stream: torch.Tensor, spec: TrainSpec,
             log: Callable[[str], None], teacher: LlamaForCausalLM | None = None) -> dict[str, float]:
    """Next-token cross-entropy; with a teacher (same tokenizer), plus KL(teacher || model) on every
    position: soft targets carry more signal per token, which matters on a CPU's token budget."""
    if teacher is not None:
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits  # [batch, seq_len, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        if teacher is None:
            return ce
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(input_ids=batch[:, :-1]).logits, dim=-1)  # [batch, seq_len, vocab]
        kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), t_logp.flatten(0, 1), log_target=True,
                      reduction="batchmean")
        return kl + ce

    return _run(model, spec, loss_fn, stream, log)


def init_draft_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start the draft from the target's embedding, first layer, final norm and (tied) head:
    same width, so it only has to learn what the target's other layers add."""
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())


def distill(draft: LlamaForCausalLM, target: LlamaForCausalLM, stream: torch.Tensor, spec: TrainSpec,
            log: Callable[[str], None], ce_weight: float = 0.1) -> dict[str, float]:
    """Minimise KL(target || draft) on every position, plus a little cross-entropy on the text."""
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]  # [batch, seq_len]
        with torch.no_grad():
            t_logp = F.log_softmax(target(input_ids=inputs).logits, dim=-1)  # [batch, seq_len, vocab]
        d_logits = draft(input_ids=inputs).logits  # [batch, seq_len, vocab]
        d_logp = F.log_softmax(d_logits, dim=-1)
        kl = F.kl_div(d_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
        ce = F.cross_entropy(d_logits.flatten(0, 1), batch[:, 1:].flatten())
        return kl + ce_weight * ce

    return _run(draft, spec, loss_fn, stream, log)


@torch.inference_mode()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int = 512, windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over evenly spaced held-out windows."""
    model.eval()
    step = max(1, (stream.numel() - seq_len - 1) // windows)
    losses = []
    for i in range(windows):
        w = stream[i * step: i * step + seq_len + 1].long()[None]  # [1, seq_len + 1]
        if w.shape[1] < seq_len + 1:
            break
        logits = model(input_ids=w[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0], w[0, 1:]).item())
    return sum(losses) / len(losses)
