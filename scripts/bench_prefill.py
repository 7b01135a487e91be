"""Prompt (prefill) cost and fidelity of the target's bf16 prefill against float32, side by side.

    .venv/bin/python scripts/bench_prefill.py [--target models/serve-target] [--lengths 64,256,512]
        [--repeats 5] [--prompts 48] [--tokens 64]

1. One prompt chunk of each length through the packed target, ``prefill_dtype`` float32 and
   bfloat16 alternating, best of ``--repeats``: ms per prompt token, and the ratio.
2. A step of 16 decode rows with k prompt rows beside them: all on the fp32 weights, or the k
   prompt rows on the bf16 copy (a second pass over the weights), which is where the engine's
   ``BF16_MIN_ROWS`` comes from.
3. Fidelity on held-out prompts (models/prompts.jsonl): the last prompt position's logits (max
   |difference| and top-1 agreement), and greedy completions through the engine (EOS ignored):
   how many are identical and how long the common prefix is.

One thread, as the workers run. The method: ``main``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar import paths  # noqa: E402
from nightjar.messages import SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import Engine, EngineRequest  # noqa: E402
from worker.engine import model as model_mod  # noqa: E402
from worker.engine.model import LlamaModel  # noqa: E402
from worker.engine.runner import ModelRunner, Run  # noqa: E402


def prompt_ids(tok, n: int, max_tokens: int | None = None) -> list[list[int]]:
    texts = [json.loads(x)["text"] for x in (ROOT / "models" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [(i[:max_tokens] if max_tokens else i) or [1] for i in ids[:n]]


def prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """ids: one prompt as one prompt run -> [V] logits at its last position."""
    runner = ModelRunner(model, -(-len(ids) // 16), 16, 0.0)
    table = list(range(runner.blocks.num_blocks))
    return runner.forward([Run(ids, 0, table, 1, prompt=True)])[0]


def mixed_step_ms(model: LlamaModel, prompt_rows: int, repeats: int, decode: int = 16) -> float:
    """Best time of one forward: ``decode`` 1-token decode runs at position 64, then one prompt chunk."""
    runner = ModelRunner(model, decode * 5 + -(-prompt_rows // 16), 16, 0.0)
    runs = [Run([7], 64, list(range(i * 5, i * 5 + 5)), 1) for i in range(decode)]
    runs.append(Run(list(range(10, 10 + prompt_rows)), 0, list(range(decode * 5, runner.blocks.num_blocks)), 1, prompt=True))
    best = float("inf")
    for _ in range(repeats + 1):  # the first call builds oneDNN's kernel for this row count
        t = time.perf_counter()
        runner.forward(runs)
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def greedy(eng: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        eng.add_request(EngineRequest(f"p{i}", ids, SamplingParams(max_tokens=tokens, ignore_eos=True)))
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"p{i}"] for i in range(len(prompts))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET)
    p.add_argument("--lengths", default="64,256,512", help="prompt chunk lengths to time")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts for the fidelity part")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.target)
    models = {d: LlamaModel.from_folder(a.target, packed=True, prefill_bf16=d == "bfloat16") for d in ("float32", "bfloat16")}
    text = sum(prompt_ids(tok, 300), [])
    print(f"## Prefill, {a.target.name}, one thread (best of {a.repeats}, alternating)\n")
    print("| prompt tokens | float32 ms/token | bfloat16 ms/token | speed-up |\n|---|---|---|---|")
    with torch.inference_mode():
        for n in (int(x) for x in a.lengths.split(",")):
            ids = text[:n]
            best = {d: float("inf") for d in models}
            for _ in range(a.repeats):
                for d, m in models.items():
                    prefill_logits(m, ids)  # oneDNN's first call at a row count builds its kernel
                    t = time.perf_counter()
                    prefill_logits(m, ids)
                    best[d] = min(best[d], (time.perf_counter() - t) * 1e3 / n)
            print(f"| {n} | {best['float32']:.3f} | {best['bfloat16']:.3f} | {best['float32'] / best['bfloat16']:.2f}× |")

        print(f"\n## 16 decode rows and k prompt rows in one step, ms (best of {a.repeats})\n")
        print("| k | all fp32 | prompt rows in bf16 | bf16 ÷ fp32 |\n|---|---|---|---|")
        min_rows, model_mod.BF16_MIN_ROWS = model_mod.BF16_MIN_ROWS, 1  # split at every k
        try:
            for k in (2, 4, 8, 16, 32, 64, 128):
                f32, split = (mixed_step_ms(models[d], k, a.repeats) for d in ("float32", "bfloat16"))
                print(f"| {k} | {f32:.2f} | {split:.2f} | {split / f32:.2f} |")
        finally:
            model_mod.BF16_MIN_ROWS = min_rows

        prompts = prompt_ids(tok, a.prompts, max_tokens=256)
        diffs, same_top = [], 0
        for ids in prompts:
            want, got = (prefill_logits(m, ids) for m in models.values())
            diffs.append((want - got).abs().max().item())
            same_top += int(want.argmax() == got.argmax())
    outs = {}
    for d in models:
        eng = Engine(EngineConfig(target_path=str(a.target), prefill_dtype=d, num_threads=1))
        outs[d] = greedy(eng, prompts, a.tokens)
    prefix = [common_prefix(x, y) for x, y in zip(outs["float32"], outs["bfloat16"])]
    print(f"\n## Fidelity, {len(prompts)} held-out prompts (≤ 256 tokens), {a.tokens} greedy tokens\n")
    print("| last-position logits: max abs diff (median / max) | top-1 agrees | identical completions | "
          "common prefix (median / mean) |\n|---|---|---|---|")
    print(f"| {statistics.median(diffs):.4f} / {max(diffs):.4f} | {same_top}/{len(prompts)} | "
          f"{sum(x == a.tokens for x in prefix)}/{len(prompts)} | {statistics.median(prefix):.0f} / "
          f"{statistics.mean(prefix):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
