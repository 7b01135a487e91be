"""The recipe's acceptance check: how often the draft's greedy guesses match the target's.

    .venv/bin/python scripts/check_acceptance.py --prompts 64 --new-tokens 64 --timing

Per-token agreement and, for every γ, the acceptance of greedy speculative decoding, from one
teacher-forced draft pass per prompt. The method: ``measure_acceptance``, which tests call on a
small sample.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from nightjar import paths  # noqa: E402
from recipe.prompts import read_prompts  # noqa: E402
from recipe.timing import decode_ms  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GAMMAS = (1, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class GammaStats:
    gamma: int
    blocks: int
    mean_accepted: float  # accepted draft tokens per block, 0..gamma
    per_position: tuple[float, ...]  # P(position k accepted | positions < k accepted), k = 1..gamma

    @property
    def tokens_per_target_pass(self) -> float:
        return self.mean_accepted + 1.0  # the target's bonus/correction token


@dataclass(frozen=True)
class AcceptanceReport:
    prompts: int
    tokens: int
    agreement: float  # fraction of continuation positions where draft argmax == target token
    gammas: tuple[GammaStats, ...]


@torch.inference_mode()
def greedy_continuation(model: PreTrainedModel, prompt: list[int], new_tokens: int, eos_id: int) -> list[int]:
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])  # [1, prompt_len]
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits  # [1, len, vocab]
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.tensor([[nxt]])  # [1, 1]
    return out


@torch.inference_mode()
def draft_matches(draft: PreTrainedModel, prompt: list[int], continuation: list[int]) -> list[bool]:
    seq = torch.tensor([prompt + continuation])  # [1, prompt_len + n]
    logits = draft(input_ids=seq).logits[0]  # [prompt_len + n, vocab]
    # position prompt_len - 1 + j predicts continuation[j]
    guesses = logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)].argmax(-1)  # [n]
    return [bool(g == t) for g, t in zip(guesses.tolist(), continuation)]


def replay_blocks(matches: list[bool], gamma: int) -> tuple[int, int, list[int], list[int]]:
    """Replay greedy speculation over one match vector with blocks of gamma proposals.
    Returns (blocks, accepted, reached[k], accepted_at[k]) for k = 0..gamma-1; only full blocks
    count, so the end of a short continuation does not bias the figures."""
    blocks = accepted = 0
    reached, acc_at = [0] * gamma, [0] * gamma
    pos = 0
    while pos + gamma <= len(matches):
        a = 0
        while a < gamma and matches[pos + a]:
            a += 1
        for k in range(min(a + 1, gamma)):
            reached[k] += 1
        for k in range(a):
            acc_at[k] += 1
        blocks += 1
        accepted += a
        pos += a + 1  # accepted proposals plus the target's own token
    return blocks, accepted, reached, acc_at


def summarize(all_matches: list[list[bool]], gammas: tuple[int, ...] = GAMMAS) -> AcceptanceReport:
    flat = [m for ms in all_matches for m in ms]
    if not flat:
        raise ValueError("no continuation tokens to measure; use longer --new-tokens")
    stats = []
    for g in gammas:
        blocks = accepted = 0
        reached, acc_at = [0] * g, [0] * g
        for ms in all_matches:
            b, a, r, c = replay_blocks(ms, g)
            blocks, accepted = blocks + b, accepted + a
            reached = [x + y for x, y in zip(reached, r)]
            acc_at = [x + y for x, y in zip(acc_at, c)]
        per_pos = tuple(c / r if r else 0.0 for c, r in zip(acc_at, reached))
        stats.append(GammaStats(g, blocks, accepted / blocks if blocks else 0.0, per_pos))
    return AcceptanceReport(len(all_matches), len(flat), sum(flat) / len(flat), tuple(stats))


def load_pair(target_dir: Path, draft_dir: Path) -> tuple[PreTrainedModel, PreTrainedModel]:
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target, draft


def measure_acceptance(target_dir: Path = paths.DEFAULT_TARGET, draft_dir: Path = paths.DEFAULT_DRAFT,
                       prompts_path: Path = ROOT / "models" / "prompts.jsonl", n_prompts: int = 8,
                       new_tokens: int = 32, seed: int = 0) -> AcceptanceReport:
    """For each held-out prompt the target decodes greedily (transformers, KV cache); the draft then
    reads prompt + continuation in one teacher-forced pass. With greedy acceptance, a proposal the
    target accepts equals the target's own token, so the draft's k-th proposal in a block is exactly
    its teacher-forced argmax at that position: one match vector per prompt gives the per-token
    agreement and, by replaying blocks of γ, the acceptance of speculative decoding for every γ
    (accepted tokens per block, and per-position acceptance rate P(k-th accepted | first k-1 were))."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    target, draft = load_pair(target_dir, draft_dir)
    prompts = read_prompts(prompts_path)
    sample = random.Random(seed).sample(prompts, min(n_prompts, len(prompts)))
    all_matches = []
    for p in sample:
        ids = tok.encode(p["text"], add_special_tokens=False)
        cont = greedy_continuation(target, ids, new_tokens, tok.eos_token_id)
        all_matches.append(draft_matches(draft, ids, cont))
    return summarize(all_matches)


def format_report(r: AcceptanceReport) -> str:
    lines = [f"prompts {r.prompts}, continuation tokens {r.tokens}, greedy agreement {r.agreement:.3f}", "",
             "| γ | blocks | accepted tokens / block | tokens / target pass | per-position acceptance (k = 1…γ) |",
             "|---|---|---|---|---|"]
    for g in r.gammas:
        pp = " ".join(f"{x:.2f}" for x in g.per_position)
        lines.append(f"| {g.gamma} | {g.blocks} | {g.mean_accepted:.2f} | {g.tokens_per_target_pass:.2f} | {pp} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(measure_acceptance),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET)
    ap.add_argument("--draft", type=Path, default=paths.DEFAULT_DRAFT)
    ap.add_argument("--prompt-file", type=Path, default=ROOT / "models" / "prompts.jsonl")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-agreement", type=float, default=0.0, help="exit 1 below this")
    ap.add_argument("--timing", action="store_true", help="also measure batch-1 decode ms/token")
    a = ap.parse_args(argv)
    r = measure_acceptance(a.target, a.draft, a.prompt_file, a.prompts, a.new_tokens, a.seed)
    print(format_report(r))
    if a.timing:
        target, draft = load_pair(a.target, a.draft)
        ms = decode_ms({"target": target, "draft": draft})
        print(f"\nbatch-1 decode forward (transformers, fp32, KV cache): target {ms['target']:.2f} ms, "
              f"draft {ms['draft']:.2f} ms, ratio {ms['target'] / ms['draft']:.2f}")
    return 0 if r.agreement >= a.min_agreement else 1


if __name__ == "__main__":
    raise SystemExit(main())
