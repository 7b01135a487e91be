"""Widen a Llama checkpoint's MLP without changing what it computes: a heavier target for benchmarks.

    .venv/bin/python scripts/widen_model.py --factor 8            # models/tiny-target → runs/models/wide8-target

Why: the shipped tiny-target's decode step is mostly per-sequence work, so speculation pays at
every batch size (BENCHMARKS, Speculation); a serving-size target's matmuls dominate instead.
This gives the shipped target that cost profile while keeping its outputs, so the draft's
acceptance and every greedy output stay exactly as measured. How: ``widen``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent


def widen_state(state: dict[str, torch.Tensor], intermediate: int, factor: int, seed: int) -> dict[str, torch.Tensor]:
    """Return a copy of ``state`` with every MLP widened from ``intermediate`` to factor×intermediate."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    extra = intermediate * (factor - 1)
    for name, w in state.items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            # w: [I, H] → [factor·I, H]; new rows at the trained rows' scale
            new = torch.randn(extra, w.shape[1], generator=g, dtype=torch.float32) * w.float().std()
            out[name] = torch.cat([w, new.to(w.dtype)], dim=0)
        elif name.endswith("mlp.down_proj.weight"):
            # w: [H, I] → [H, factor·I]; zero columns: the new neurons write nothing
            out[name] = torch.cat([w, w.new_zeros(w.shape[0], extra)], dim=1)
        else:
            out[name] = w
    return out


def widen(src: Path, dst: Path, factor: int, seed: int = 0) -> Path:
    """Write ``src`` widened ``factor`` times into ``dst``; the output goes under runs/ (git-ignored).

    On this CPU the shipped tiny-target's decode step is mostly per-sequence work (Python,
    attention over each sequence's KV), so verifying γ more tokens per sequence is nearly free and
    speculation pays at every batch size. A serving-size target is the opposite: its matmuls
    dominate, a verify pass costs in proportion to the tokens it checks, and past some batch size
    speculation costs more than it saves. The widened model keeps the outputs:

    - each layer's MLP grows from I to factor×I neurons;
    - the new gate/up rows are random (dense, so a GEMM does the full work: nothing in the matmul
      path skips zeros, and the rows are not zeros anyway), the new down_proj columns are zero, so
      the new neurons add exactly 0 to the residual stream.

    Attention, the KV cache's bytes per token and the tokenizer are untouched, so the [memory]
    accounting (KV blocks per MiB, the draft's share) is the same as with the shipped target. It is
    derived, never shipped."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("mlp_bias"):
        raise ValueError(f"{src}: only bias-free Llama MLPs can be widened")
    intermediate = int(config["intermediate_size"])
    state = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "train_stats.json"):
            shutil.copy2(f, dst / f.name)
    save_file(widen_state(state, intermediate, factor, seed), str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["intermediate_size"] = intermediate * factor
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "WIDENED.json").write_text(json.dumps({"source": str(src), "factor": factor, "seed": seed,
                                                   "intermediate_size": [intermediate, intermediate * factor]}) + "\n")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "models" / "tiny-target")
    ap.add_argument("--factor", type=int, default=8, help="MLP width multiplier")
    ap.add_argument("--out", type=Path, default=None, help="default runs/models/wide{factor}-target")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.out or ROOT / "runs" / "models" / f"wide{args.factor}-target"
    print(widen(args.src, out, args.factor, args.seed))


if __name__ == "__main__":
    main()
