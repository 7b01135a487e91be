"""The CPU linear paths against the machine's floors, on a model's own weight matrices.

    .venv/bin/python scripts/bench_linear.py [--model models/serve-target] [--rows 1,2,4,...] [--repeats 5]

Prints ms per decode/verify step for each path beside the weight-bandwidth and FLOP floors
measured on this machine, so each path's distance from the hardware shows. The method: ``main``.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nightjar import paths  # noqa: E402
from worker.engine import linear  # noqa: E402
from worker.engine.linear import pack, packed_linear  # noqa: E402
from worker.engine.loader import fused_weights, load_config, load_state_dict  # noqa: E402


def _matrices(folder: Path) -> list[torch.Tensor]:
    """[out, in] fp32 weight matrices of one step, in execution order."""
    cfg = load_config(folder)
    w = fused_weights(cfg, load_state_dict(folder), torch.float32, "cpu")
    mats = [layer[k] for layer in w["layers"] for k in ("qkv", "o", "gate_up", "down")]
    return mats + [w["head"]]


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def read_bandwidth_gbs() -> float:
    """One core's read bandwidth from DRAM: a sum over a tensor far larger than the L3."""
    big = torch.ones(64 * 2**20)  # 256 MiB
    ms = min(_time(lambda: big.sum(), 3) for _ in range(3))
    return big.numel() * 4 / ms / 1e6


def peak_gflops() -> float:
    """One core's fp32 matmul peak: the fastest of MKL, packed oneDNN and the panel kernel on a
    1024-cube product (compute-bound; MKL does not take its best kernels on every CPU)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    packs = [pack(b, "onednn")] + ([pack(b, "panel")] if linear.kernel() else [])
    ms = min(min([_time(lambda: a @ b, 5)] + [_time(lambda: packed_linear(a, bp), 5) for bp in packs])
             for _ in range(3))
    return 2 * 1024**3 / ms / 1e6


def main(argv: list[str] | None = None) -> int:
    """One "step" is every weight matrix of the model (each layer's qkv, o, gate_up, down, and the head)
    applied once to an [M, in] activation, as a decode/verify step does. Prints a markdown table of
    ms per step for each path, beside two floors measured on this machine: the weight bytes divided
    by the measured read bandwidth of one core, and the FLOPs divided by the measured peak of one
    core (a large in-cache matmul). Single-threaded, as a worker runs on these 2-core machines.
    Paths are interleaved within each repeat and the median is reported."""
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=paths.DEFAULT_TARGET)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    mats = _matrices(a.model)
    wt = [m.t().contiguous() for m in mats]  # the engine's former layout: x @ W^T, [in, out]
    onednn = [pack(m, "onednn") for m in mats]
    panels = [pack(m, "panel") for m in mats] if linear.kernel() else []
    n_bytes = sum(m.numel() * 4 for m in mats)
    bw, peak = read_bandwidth_gbs(), peak_gflops()
    print(f"model {a.model.name}: {len(mats)} matrices, {n_bytes / 1e6:.1f} MB fp32; "
          f"read bandwidth {bw:.1f} GB/s, matmul peak {peak:.0f} GFLOP/s (1 core)\n")
    paths_ = {  # xs: one [M, in] input per distinct input width
        "x @ W^T (MKL)": lambda xs: [xs[w.shape[0]] @ w for w in wt],
        "F.linear (MKL)": lambda xs: [F.linear(xs[m.shape[1]], m) for m in mats],
        "packed (oneDNN)": lambda xs: [packed_linear(xs[m.shape[1]], p) for p, m in zip(onednn, mats)],
    }
    if panels:  # the engine's path where the kernel builds
        paths_["panel kernel"] = lambda xs: [packed_linear(xs[m.shape[1]], p) for p, m in zip(panels, mats)]
    engine = list(paths_)[-1]
    rows = [int(r) for r in a.rows.split(",")]
    print("| M | " + " | ".join(f"{k} ms" for k in paths_) + f" | bytes floor ms | FLOP floor ms | {engine} ÷ floor |"
          f" {engine} ÷ M=1 |")
    print("|---|" + "---|" * (len(paths_) + 4))
    base = None
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in mats}}
        samples: dict[str, list[float]] = {k: [] for k in paths_}
        reps = max(2, int(64 / m ** 0.5))
        for r in range(a.repeats):
            order = list(paths_) if r % 2 == 0 else list(reversed(paths_))
            for k in order:
                fn = paths_[k]
                samples[k].append(_time(lambda: fn(xs), reps))
        med = {k: statistics.median(v) for k, v in samples.items()}
        flops = sum(2 * m * w.shape[0] * w.shape[1] for w in mats)
        floor_b, floor_f = n_bytes / bw / 1e6, flops / peak / 1e6
        base = base or med[engine]
        print(f"| {m} | " + " | ".join(f"{med[k]:.2f}" for k in paths_)
              + f" | {floor_b:.2f} | {floor_f:.2f} | {med[engine] / max(floor_b, floor_f):.2f} |"
              f" {med[engine] / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
