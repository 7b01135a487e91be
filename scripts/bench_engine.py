"""Autoregressive throughput of the engine vs transformers, side by side in one run.

    .venv/bin/python scripts/bench_engine.py [--concurrency 1,4,16,64] [--threads 1] [--profile]

The same held-out prompts and output lengths (EOS ignored) through the engine, through
transformers one request at a time and on padded batches: tokens/s per concurrency, both sides
under the same machine load. The method: ``main``.
"""

from __future__ import annotations

import argparse
import inspect
import json
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


def load_workload(tok, n: int, prompt_tokens: int, lengths: list[int]) -> list[tuple[list[int], int]]:
    texts = [json.loads(x)["text"] for x in (ROOT / "models" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for i in range(n):
        ids = tok(texts[i % len(texts)], add_special_tokens=False)["input_ids"][:prompt_tokens] or [1]
        out.append((ids, lengths[i % len(lengths)]))
    return out


def run_engine(eng: Engine, work, concurrency: int) -> float:
    pending = list(enumerate(work))
    in_flight = 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and in_flight < concurrency:
            i, (ids, n) = pending.pop(0)
            eng.add_request(EngineRequest(f"b{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True)))
            in_flight += 1
        for o in eng.step():
            in_flight -= o.finished
    return time.perf_counter() - t0


def run_hf(model, work, batch: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(work), batch):
            group = work[s:s + batch]
            width = max(len(ids) for ids, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for r, (p, _) in enumerate(group):  # left padding
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            n = max(k for _, k in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
    return time.perf_counter() - t0


def read_bandwidth_gbs() -> float:
    """Read bandwidth: a sum over a 256 MiB tensor (streams it once, writes nothing), best of 10."""
    a = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def profile_batch1(eng: Engine, work) -> dict:
    """Batch-1 decode: ms/token, and where a step's time goes. cProfile, not torch.profiler:
    the latter's per-op cost (tens of us) is as large as the ops of a model this small."""
    import cProfile
    import pstats

    ids, _ = work[0]
    eng.add_request(EngineRequest("prof", ids, SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(8):  # prefill + warm decode
        eng.step()
    steps = 40
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    per_token_ms = (time.perf_counter() - t) / steps * 1e3
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    while eng.has_unfinished():
        eng.step()
    kinds = {"matmul": ("linear", "addmm", "matmul"), "attention (sdpa)": ("scaled_dot_product_attention",),
             "kv gather/write": ("index_select", "index_copy_"), "rmsnorm": ("rms_norm",)}
    groups: dict[str, float] = {}
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in pstats.Stats(prof).stats.items():
        ms = tt * 1e3 / steps
        if func == "_lin":  # x @ W is an operator, not a call: its time is _lin's own time
            kind = "matmul"
        elif file == "~":
            kind = next((k for k, keys in kinds.items() if any(key in func for key in keys)), "other torch ops")
        else:
            kind = "python (engine + model code)"
        groups[kind] = groups.get(kind, 0.0) + ms
    model = eng.runner.model
    embed = model.w["embed"]
    # bytes one decode step must stream: every weight but the embedding table (one row is read)
    weight_bytes = model.weight_bytes - (embed.numel() * embed.element_size() if model.w["head"] is not embed else 0)
    bw = read_bandwidth_gbs()
    return {"per_token_ms": per_token_ms, "profiled_step_ms": wall_ms, "weight_bytes": weight_bytes,
            "bandwidth_gbs": bw, "floor_ms": weight_bytes / bw / 1e6,
            "breakdown_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    """Workload: held-out prompts (models/prompts.jsonl, cut to --prompt-tokens) with mixed output
    lengths (cycling --lengths), EOS ignored so every system produces exactly the same tokens.
    For each concurrency c:
      engine       c requests in flight (closed loop: a finished one is replaced at once)
      hf-single    transformers generate(do_sample=False), one request at a time
      hf-padded    transformers generate on left-padded batches of c (a batch runs to its longest
                   request; only the requested tokens count)
    Tokens/s = requested completion tokens / wall seconds, prefill included for everyone. The box
    is shared, so both sides are measured under the same load: at c = 1 engine and transformers
    alternate request by request; at c > 1 each runs --reps times, alternating, best kept.
    --profile adds the batch-1 decode breakdown (cProfile) and the physical floor (bytes a decode
    step must stream / measured read bandwidth)."""
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(paths.DEFAULT_TARGET))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--lengths", default="16,32,48,64,24,40")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(12, 2c))")
    ap.add_argument("--single-requests", type=int, default=12, help="requests for hf-single (a rate)")
    ap.add_argument("--reps", type=int, default=2, help="alternating runs per level (c > 1), best kept")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    eng = Engine(EngineConfig(target_path=args.target, num_threads=args.threads, max_running=64))
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    lengths = [int(x) for x in args.lengths.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    warm = load_workload(eng.tokenizer, 2, args.prompt_tokens, [8])
    run_engine(eng, warm, 2)
    run_hf(hf, warm, 2)
    # one request at a time, engine and transformers alternating request by request, so both
    # see the same machine load (the box is shared)
    single_work = load_workload(eng.tokenizer, args.single_requests, args.prompt_tokens, lengths)
    t_eng = t_hf = 0.0
    for w in single_work:
        t_eng += run_engine(eng, [w], 1)
        t_hf += run_hf(hf, [w], 1)
    single_tokens = sum(n for _, n in single_work)
    hf_single_tps, eng_single_tps = single_tokens / t_hf, single_tokens / t_eng
    rows = []
    print(f"threads={args.threads}  hf-single: {hf_single_tps:.1f} tok/s ({args.single_requests} requests)")
    print(f"{'conc':>5} {'requests':>8} {'engine tok/s':>13} {'hf-single':>10} {'hf-padded':>10} "
          f"{'x single':>9} {'x padded':>9}")
    for c in levels:
        work = load_workload(eng.tokenizer, args.requests or max(12, 2 * c), args.prompt_tokens, lengths)
        tokens = sum(n for _, n in work)
        if c == 1:
            e, p = eng_single_tps, hf_single_tps
        else:  # best of --reps alternating runs each
            e = p = 0.0
            for _ in range(args.reps):
                e = max(e, tokens / run_engine(eng, work, c))
                p = max(p, tokens / run_hf(hf, work, c))
        row = {"concurrency": c, "requests": len(work) if c > 1 else len(single_work), "engine_tps": e,
               "hf_single_tps": hf_single_tps, "hf_padded_tps": p, "x_single": e / hf_single_tps, "x_padded": e / p}
        rows.append(row)
        print(f"{c:>5} {row['requests']:>8} {e:>13.1f} {hf_single_tps:>10.1f} {p:>10.1f} {row['x_single']:>9.2f} "
              f"{row['x_padded']:>9.2f}", flush=True)
    result = {"threads": args.threads, "rows": rows}
    if args.profile:
        prof = profile_batch1(eng, single_work)
        result["profile"] = prof
        print(f"\nbatch-1 decode: {prof['per_token_ms']:.2f} ms/token; floor {prof['floor_ms']:.2f} ms "
              f"({prof['weight_bytes'] / 1e6:.1f} MB weights / {prof['bandwidth_gbs']:.1f} GB/s read bandwidth)")
        print(f"profiled step {prof['profiled_step_ms']:.2f} ms, by op (ms/step): "
              + ", ".join(f"{k} {v:.2f}" for k, v in prof["breakdown_ms"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
