#!/usr/bin/env python
"""The target's decode/verify step with the C paged-attention kernel against torch's gather + SDPA.

    .venv/bin/python scripts/bench_attention.py [--model models/serve-target] [--repeats 3]

One model, one KV pool; B sequences with contexts drawn from 64..320 tokens in scattered
blocks, Q = γ + 1 new tokens each. The two paths alternate on the same inputs (order flipped
every repeat) so that machine drift hits both alike; each cell is the median over repeats of
the interquartile mean of 8 steps. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar import paths  # noqa: E402
from worker.engine.model import LlamaModel  # noqa: E402
from worker.engine.runner import ModelRunner, Run  # noqa: E402


def step_ms(runner: ModelRunner, runs: list[Run], steps: int = 8) -> float:
    runner.forward(runs)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.forward(runs)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    q = steps // 4
    return 1000 * statistics.mean(ts[q:steps - q])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(paths.DEFAULT_TARGET))
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--q-lens", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = LlamaModel.from_folder(a.model, packed=True)
    if not model.paged_attention:
        print("the paged attention kernel is not available here", file=sys.stderr)
        return 1
    bs, rng = 16, random.Random(0)
    rows = ["| batch | Q (= γ+1) | gather + SDPA ms | paged kernel ms | speedup |", "|---:|---:|---:|---:|---:|"]
    for b in map(int, a.batches.split(",")):
        for q in map(int, a.q_lens.split(",")):
            ctx = [rng.randint(64, 320) for _ in range(b)]
            need = [(c + q + bs - 1) // bs for c in ctx]
            runner = ModelRunner(model, sum(need) + 1, bs, 0.0)
            free = list(range(1, sum(need) + 1))
            rng.shuffle(free)  # scattered blocks, as after a while of serving
            runs = []
            for c, n in zip(ctx, need):
                runs.append(Run([rng.randrange(1000) for _ in range(q)], c, free[:n], q))
                free = free[n:]
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(a.repeats):
                for paged in ((False, True) if r % 2 == 0 else (True, False)):
                    model.paged_attention = paged
                    times[paged].append(step_ms(runner, runs))
            g, k = statistics.median(times[False]), statistics.median(times[True])
            rows.append(f"| {b} | {q} | {g:.1f} | {k:.1f} | {g / k:.2f}× |")
            print(rows[-1], file=sys.stderr, flush=True)
            del runner
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
