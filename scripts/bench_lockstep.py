"""Does a closed loop's cohort cost more when its requests end on different steps?

In a closed loop of fixed-length requests at γ = 0 the requests start together and end together
(lockstep): the replacements are prefilled in one step, and every other step is pure decode.
A speculated step breaks that (its sequences gain different numbers of tokens), after which a
prefill rides in most steps. This runs the same in-process closed loop on the engine alone,
both ways, so the stack's gateway round trips are out of the figure:

    .venv/bin/python scripts/bench_lockstep.py [--clients 48] [--repeats 3]

lockstep: all clients start on step 0; staggered: one client starts per step. Each finished
request is replaced on the spot (32-token prompt, 64 tokens out, EOS ignored, as ``closed:C``).
Tokens/s over ``--steps`` after ``--warmup`` steps, and the cost per token of the pure decode
steps; the two orders alternate between repeats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar import paths  # noqa: E402
from nightjar.messages import SamplingParams  # noqa: E402
from nightjar_tools.bench.workload import CLOSED_OUTPUT_TOKENS, CLOSED_PROMPT_TOKENS  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import Engine, EngineRequest  # noqa: E402


def closed_loop(eng: Engine, clients: int, stagger: bool, warmup: int, steps: int, seed: int) -> tuple[float, float, int]:
    """-> (tokens/s, ms per token of pure decode steps, steps that carried prefill)."""
    rnd, vocab, n = random.Random(seed), eng.runner.model.cfg.vocab_size, 0

    def add() -> None:
        nonlocal n
        n += 1
        eng.add_request(EngineRequest(f"c{seed}-{n}", [rnd.randrange(vocab) for _ in range(CLOSED_PROMPT_TOKENS)],
                                      SamplingParams(max_tokens=CLOSED_OUTPUT_TOKENS, ignore_eos=True)))

    started, pure_ms, pure_tokens, mixed, tokens, t0 = 0, 0.0, 0, 0, 0, 0.0
    for i in range(warmup + steps):
        while started < (min(clients, i + 1) if stagger else clients):
            add()
            started += 1
        if i == warmup:
            t0, tokens = time.perf_counter(), 0
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                add()
        s = eng.last_stats
        if i >= warmup and s is not None:
            if s.prefill_tokens:
                mixed += 1
            else:
                pure_ms, pure_tokens = pure_ms + s.step_ms, pure_tokens + s.emitted_tokens
    wall = time.perf_counter() - t0
    for seq in [*eng.scheduler.running, *eng.scheduler.waiting]:
        eng.abort(seq.request_id)
    while eng.has_unfinished():
        eng.step()
    return tokens / wall, pure_ms / max(pure_tokens, 1), mixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(paths.DEFAULT_TARGET))
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=640)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    eng = Engine(EngineConfig(target_path=a.target, draft_path=None, num_threads=a.threads,
                              max_running=max(64, a.clients), kv_budget_bytes=256 << 20))
    runs: dict[str, list[float]] = {"lockstep": [], "staggered": []}
    for rep in range(a.repeats):
        order = ["lockstep", "staggered"] if rep % 2 == 0 else ["staggered", "lockstep"]
        for name in order:
            tps, ms, mixed = closed_loop(eng, a.clients, name == "staggered", a.warmup, a.steps, 10 * rep + len(name))
            runs[name].append(tps)
            print(f"repeat {rep + 1} {name:9s}: {tps:7.1f} tok/s; pure decode {ms:.3f} ms/token; "
                  f"{mixed} of {a.steps} steps carried prefill", flush=True)
    print(f"\nstaggered ÷ lockstep, median: {statistics.median(runs['staggered']) / statistics.median(runs['lockstep']):.3f}")


if __name__ == "__main__":
    main()
