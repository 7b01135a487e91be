"""The speculation cost surface of this machine: decode step time and tokens/s for every
(batch size, γ), acceptance per draft position, and the draft catch-up cost.

    .venv/bin/python scripts/bench_speculation.py [--batches 1,2,4,8,16,32,64] [--gamma-max 6]

Writes planner_svc/cost_surfaces/cpu_NAME.json (the planner's simulator input and prior; format
in BENCHMARKS.md) and benchmarks/speculation_tokens_per_s_NAME.png, NAME from the target folder.
The method: ``main``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
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


def prompts(tok, n: int, max_tokens: int, offset: int = 0) -> list[list[int]]:
    texts = [json.loads(x)["text"] for x in (ROOT / "models" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    return [tok(texts[(offset + i) % len(texts)], add_special_tokens=False)["input_ids"][:max_tokens] or [1]
            for i in range(n)]


def measure_batch(eng: Engine, b: int, gammas: list[int], steps: int, rounds: int, prompt_tokens: int, temperature: float,
                  offset: int = 0):
    ps = prompts(eng.tokenizer, b, prompt_tokens, offset)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=temperature, seed=1)
    for i, p in enumerate(ps):
        eng.add_request(EngineRequest(f"s{b}-{i}", p, params))
    eng.set_gamma_policy(lambda n: 0)
    while eng.num_waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
    times = {g: [] for g in gammas}
    emitted = {g: 0 for g in gammas}
    accepted = {g: [0] * g for g in gammas}
    verified = {g: 0 for g in gammas}
    catchups = []
    for _ in range(rounds):
        for g in gammas:
            eng.set_gamma_policy(lambda n, g=g: g)
            for k in range(steps + 1):
                eng.step()
                st = eng.last_stats
                assert st.batch_size == b and st.gamma == g, (st, eng.num_running, eng.num_waiting)
                if st.catchup_tokens:
                    catchups.append((st.catchup_tokens, st.catchup_ms))
                if k == 0:
                    continue
                times[g].append(st.step_ms)
                emitted[g] += st.emitted_tokens
                verified[g] += b
                for i, a in enumerate(st.accepted_per_position):
                    accepted[g][i] += a
    for s in [*eng.scheduler.running, *eng.scheduler.waiting]:
        eng.abort(s.request_id)
    eng.step()
    return times, emitted, accepted, verified, catchups


def iq_mean(xs: list[float]) -> float:
    """Mean of the middle half: the box is shared, and another process's burst lands on a
    random cell; the interquartile mean drops those spikes and is still a mean."""
    xs = sorted(xs)
    k = len(xs) // 4
    mid = xs[k: len(xs) - k] or xs
    return sum(mid) / len(mid)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    a = torch.stack([torch.ones_like(x), x], 1)
    sol = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.flatten()
    if sol[0] < 0:  # noise pushed the intercept below zero: fit through the origin instead
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(sol[0]), float(sol[1])


def main(argv: list[str] | None = None) -> int:
    """For each batch size B: B held-out prompts are prefilled, then rounds of γ = 0..γmax blocks of
    --steps decode steps run in turn (round robin, so context growth and machine noise fall on
    every γ alike); batches smaller than --min-prompts repeat this with the next prompts. The first
    step of each block is discarded from the step times (it carries the catch-up when γ was 0
    before); the catch-ups are recorded separately and fitted as
    catchup_ms = fixed + per_token * tokens. Step time per cell = interquartile mean (the box is
    shared); tokens/s = mean tokens per step / that step time. Greedy decoding, EOS ignored."""
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(paths.DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(paths.DEFAULT_DRAFT))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--gamma-max", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per (γ, round)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--min-prompts", type=int, default=16,
                    help="small batches repeat with the next prompts until this many were decoded: "
                         "acceptance varies by prompt, and batch 1 would otherwise rest on one")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    ap.add_argument("--kv-mib", type=int, default=768, help="KV budget: 64 sequences must grow without preemption")
    ap.add_argument("--out", default=None, help="default planner_svc/cost_surfaces/cpu_NAME.json, NAME the target's "
                                                  "folder without '-target' (serve, tiny)")
    ap.add_argument("--plot", default=None, help="default benchmarks/speculation_tokens_per_s_NAME.png")
    args = ap.parse_args(argv)
    name = Path(args.target).name.removesuffix("-target")
    args.out = args.out or str(ROOT / "planner_svc" / "cost_surfaces" / f"cpu_{name}.json")
    args.plot = args.plot or str(ROOT / "benchmarks" / f"speculation_tokens_per_s_{name}.png")
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    gammas = list(range(args.gamma_max + 1))
    dev = {"device": args.device, "dtype": args.dtype}
    eng = Engine(EngineConfig(target_path=args.target, draft_path=args.draft, num_threads=args.threads, **dev,
                              max_running=max(batches + [2]), gamma_max=args.gamma_max, kv_budget_bytes=args.kv_mib << 20,
                              max_batched_tokens=max(512, max(batches) * (args.gamma_max + 1))))
    measure_batch(eng, 2, [0, 2], 2, 1, args.prompt_tokens, args.temperature)  # warm-up
    step_ms, tps, all_catchups = [], [], []
    acc_num = [0] * args.gamma_max
    acc_den = [0] * args.gamma_max
    t_start = time.time()
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(f"tokens/s ({mode}, threads={args.threads}); columns γ = {gammas}")
    for b in batches:
        times, emitted, accepted, verified, catchups = measure_batch(
            eng, b, gammas, args.steps, args.rounds, args.prompt_tokens, args.temperature)
        for k in range(1, -(-args.min_prompts // b)):  # more prompts for small batches, same cells
            t2, e2, a2, v2, c2 = measure_batch(eng, b, gammas, args.steps, args.rounds, args.prompt_tokens,
                                               args.temperature, offset=k * b)
            for g in gammas:
                times[g] += t2[g]
                emitted[g] += e2[g]
                verified[g] += v2[g]
                accepted[g] = [x + y for x, y in zip(accepted[g], a2[g])]
            catchups += c2
        all_catchups += catchups
        step_ms.append([iq_mean(times[g]) for g in gammas])
        # tokens per step (exact) over a noise-robust step time
        tps.append([emitted[g] / len(times[g]) / (step_ms[-1][g] / 1e3) for g in gammas])
        for g in gammas:
            for i in range(g):  # P(position i+1 accepted | positions 1..i accepted)
                acc_num[i] += accepted[g][i]
                acc_den[i] += accepted[g][i - 1] if i else verified[g]
        best = max(gammas, key=lambda g: tps[-1][g])
        print(f"B={b:>3}: " + " ".join(f"{x:8.1f}" for x in tps[-1])
              + f"   best γ={best} ({tps[-1][best] / tps[-1][0]:.2f}x γ=0)", flush=True)
    acceptance = [acc_num[i] / acc_den[i] if acc_den[i] else 0.0 for i in range(args.gamma_max)]
    fixed, per_token = fit_line(all_catchups)
    crossover = next((b for b, row in zip(batches, tps) if max(range(len(row)), key=row.__getitem__) == 0), None)
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else
             f"{platform.processor() or platform.machine()} {torch.get_num_threads()} torch thread(s), shared 2-core dev box")
    machine = f"{where}, torch {torch.__version__}, {Path(args.target).name}+{Path(args.draft).name} {args.dtype}"
    surface = {"machine": machine, **({} if args.device.startswith("cuda") else {"cpu": paths.cpu_signature(), "l3_kib": paths.cpu_l3_kib()}),
               "batch_sizes": batches, "gammas": gammas, "step_ms": step_ms,
               "acceptance_per_position": acceptance, "catchup_ms_fixed": fixed, "catchup_ms_per_token": per_token,
               "tokens_per_s": tps, "crossover_batch_size": crossover,
               "step_ms_statistic": "interquartile mean of steady decode steps (first step after a γ change excluded)",
               "measured_unix_s": int(t_start), "wall_s": round(time.time() - t_start, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(surface, indent=1))
    print(f"\nacceptance per position: {[round(a, 3) for a in acceptance]}")
    print(f"catch-up: {fixed:.2f} ms + {per_token * 1e3:.1f} us/token over {len(all_catchups)} catch-ups "
          f"({min(t for t, _ in all_catchups) if all_catchups else 0}..{max(t for t, _ in all_catchups) if all_catchups else 0} tokens)")
    print(f"batch-1 best γ speedup: {max(tps[0]) / tps[0][0]:.2f}x;  crossover (γ=0 best from) batch size: {crossover}")
    print(f"wrote {args.out}")
    # γ = 0 must cost nothing for having a draft loaded: the same steps on an engine without one
    plain = Engine(EngineConfig(target_path=args.target, num_threads=args.threads, max_running=max(batches), **dev,
                                kv_budget_bytes=args.kv_mib << 20,
                                max_batched_tokens=max(512, max(batches) * (args.gamma_max + 1))))
    for b in [x for x in (1, 16) if x in batches]:
        with_draft = without = 0.0
        for _ in range(args.rounds):  # alternate the two engines, same load for both
            t_with, *_ = measure_batch(eng, b, [0], args.steps * 2, 1, args.prompt_tokens, args.temperature)
            t_without, *_ = measure_batch(plain, b, [0], args.steps * 2, 1, args.prompt_tokens, args.temperature)
            with_draft += iq_mean(t_with[0]) / args.rounds
            without += iq_mean(t_without[0]) / args.rounds
        surface.setdefault("gamma0_overhead", {})[str(b)] = {"with_draft_ms": with_draft, "no_draft_ms": without}
        print(f"γ=0 step at B={b}: {with_draft:.2f} ms with a draft loaded vs {without:.2f} ms without "
              f"({(with_draft / without - 1) * 100:+.1f}%)")
    Path(args.out).write_text(json.dumps(surface, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for g in gammas:
            ax.plot(batches, [row[g] / row[0] for row in tps], marker="o", label=f"γ={g}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s relative to γ=0")
        ax.set_title(f"Speculation speedup by batch size ({Path(args.target).name} + {Path(args.draft).name}, "
                     f"{'CPU' if args.device == 'cpu' else where})")
        ax.legend(ncol=4, fontsize=8)
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
