"""What decode and verify rows would cost on the target's bf16 copy: a measurement, not an engine option.

    .venv/bin/python scripts/bench_decode_bf16.py [--target models/serve-target] [--draft models/serve-draft]
        [--batches 1,4,8,16,32,48,64,128] [--gamma 3] [--tokens-per-step 2.5] [--repeats 7]

The engine runs decode and verify rows on the fp32 weights (the panel kernel), so that its logits
match transformers' fp32 ones; only prompt rows may run in bf16 (``--prefill-dtype``). This
times one target forward of B sequences at γ = 0 (one row each) and at ``--gamma`` (γ + 1 rows
each), every row on the fp32 weights, then every row on the bf16 copy (the prompt rows' path:
oneDNN's inner product, AMX where the CPU has it; the LM head stays fp32 there too), and the
draft's γ proposal passes at B rows.
From those: speculation's tokens/s over γ = 0's, E · t(γ=0) / (t(γ) + γ · t_draft), at
``--tokens-per-step`` tokens per sequence and step (fixed:3 emitted 2.4–2.6 live). Each cell is
the median of ``--repeats``, fp32 and bf16 alternating; one thread, as the workers run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nightjar import paths  # noqa: E402
from worker.engine.kv_cache import KVCache, build_paged_batch  # noqa: E402
from worker.engine.linear import can_bf16  # noqa: E402
from worker.engine.model import LlamaModel  # noqa: E402

CONTEXT = 100  # tokens already in each sequence's KV (the live traces' mean context is ~90)
BLOCK = 16


def forward(model: LlamaModel, kv: KVCache, batch: int, rows: int, bf16: bool) -> Callable[[], torch.Tensor]:
    """-> a closure running one forward of ``batch`` sequences, ``rows`` new tokens each, all rows
    on the bf16 copy when ``bf16`` (forward's prompt-row path from row 0)."""
    per_seq = -(-(CONTEXT + rows) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    pb = build_paged_batch([CONTEXT] * batch, [rows] * batch, tables, BLOCK, model.device)
    ids = torch.randint(5, model.cfg.vocab_size, (batch * rows,))
    logit_rows = torch.arange(batch * rows)  # the verifier reads every row's logits
    return lambda: model.forward(ids, pb, kv, logit_rows, 0 if bf16 else None)


def median_ms(fns: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(2):  # oneDNN builds a kernel per row count on its first call
            f()
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=paths.DEFAULT_TARGET)
    p.add_argument("--draft", type=Path, default=paths.DEFAULT_DRAFT)
    p.add_argument("--batches", default="1,4,8,16,32,48,64,128")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--tokens-per-step", type=float, default=2.5, help="tokens a sequence emits per step at --gamma")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    if not can_bf16():
        print("oneDNN has no native bf16 path on this CPU (AMX or AVX512-BF16): nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    target = LlamaModel.from_folder(a.target, packed=True, prefill_bf16=True)
    draft = LlamaModel.from_folder(a.draft)  # as the engine holds a draft that can move: unpacked
    batches = [int(b) for b in a.batches.split(",")]
    blocks = max(batches) * -(-(CONTEXT + a.gamma + 1) // BLOCK)
    c, d = target.cfg, draft.cfg
    kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, blocks, torch.float32, "cpu")
    dkv = KVCache(d.num_layers, d.num_kv_heads, d.head_dim, BLOCK, blocks, torch.float32, "cpu")
    g, e = a.gamma, a.tokens_per_step
    print(f"## Target step in ms, fp32 rows against bf16 rows ({a.target.name}, one thread, median of {a.repeats})\n")
    print(f"| batch | γ=0 fp32 | γ={g} fp32 | γ=0 bf16 | γ={g} bf16 | draft, {g} passes | γ={g} ÷ γ=0 tokens/s, fp32 | "
          f"bf16 |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for b in batches:
            ms = median_ms({"f0": forward(target, kv, b, 1, False), "fg": forward(target, kv, b, g + 1, False),
                            "b0": forward(target, kv, b, 1, True), "bg": forward(target, kv, b, g + 1, True),
                            "d": forward(draft, dkv, b, 1, False)}, a.repeats)
            spec = g * ms["d"]
            fp32, bf16 = (e * ms[z] / (ms[s] + spec) for z, s in (("f0", "fg"), ("b0", "bg")))
            print(f"| {b} | {ms['f0']:.1f} | {ms['fg']:.1f} | {ms['b0']:.1f} | {ms['bg']:.1f} | {spec:.1f} | "
                  f"{fp32:.2f} | {bf16:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
