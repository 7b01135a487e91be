"""One prepared check of the elastic-memory CUDA path, for a machine with a GPU (CI does not run it).

    .venv/bin/python scripts/device_check_cuda.py [--draft-gb 2.0] [--json out.json]

Seven checks (``main``), each printing PASS / FAIL / WARN / SKIP; the exit code is 1 if any FAIL.
Without CUDA the CUDA-only checks say SKIP and the same code paths run on the CPU with a small
synthetic draft, so the script itself is tested anywhere. Writes a JSON summary to --json, or
to $OUT/device_check.json when $OUT is set (the device tool's output folder).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
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
from worker.engine.draft_mover import DraftMover, plain_copy_seconds  # noqa: E402
from worker.engine.engine import Engine, EngineRequest  # noqa: E402
from worker.engine.loader import ModelConfig  # noqa: E402
from worker.engine.model import LlamaModel  # noqa: E402

RESULTS: dict = {"checks": {}}


def report(name: str, status: str, detail: str, **data) -> None:
    RESULTS["checks"][name] = {"status": status, "detail": detail, **data}
    print(f"[{status:4}] {name:10} {detail}", flush=True)


def synthetic_draft(gb: float, dtype: torch.dtype, device: str, small: bool) -> LlamaModel:
    """A Llama-shaped model of about ``gb`` GB (1B-class layer shapes, or tiny ones on the CPU
    path), weights filled, not trained."""
    hidden, inter, vocab, heads, kv_heads, hd = (256, 1024, 4096, 8, 4, 32) if small else (2048, 8192, 32000, 16, 8, 128)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = ((heads + 2 * kv_heads) * hd * hidden + hidden * heads * hd + 3 * inter * hidden + 2 * hidden) * elem
    fixed = (2 * vocab * hidden + hidden) * elem
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_type="default", rope_params=(), max_position_embeddings=2048,
                      tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,))

    def t(*shape):
        return torch.full(shape, 0.01, dtype=dtype, device=device)

    w = {"embed": t(vocab, hidden), "norm": t(hidden), "head": t(vocab, hidden), "layers": [
        {"ln1": t(hidden), "qkv": t((heads + 2 * kv_heads) * hd, hidden), "qkv_bias": None, "o": t(hidden, heads * hd),
         "ln2": t(hidden), "gate_up": t(2 * inter, hidden), "down": t(hidden, inter)} for _ in range(layers)]}
    return LlamaModel(cfg, w, dtype, device)


def decode_engine(args, device: str) -> Engine:
    return Engine(EngineConfig(target_path=args.target, device=device, dtype=args.dtype, kv_budget_bytes=64 << 20,
                               num_threads=None if device != "cpu" else 1))


def keep_busy(eng: Engine, n: int = 16) -> None:
    prompt = eng.tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    for i in range(n):
        eng.add_request(EngineRequest(f"busy{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=100_000,
                                                                                                ignore_eos=True)))
    while eng.num_waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()


def stop_all(eng: Engine) -> None:
    for s in [*eng.scheduler.running, *eng.scheduler.waiting]:
        eng.abort(s.request_id)
    while eng.has_unfinished():
        eng.step()


def timed_steps(eng: Engine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()  # ends in .tolist(): waits for the compute stream only, never the side stream
        out.append(time.perf_counter() - t0)
    return out


def move_while_decoding(eng: Engine, mover: DraftMover, direction: str) -> dict:
    t0 = time.perf_counter()
    mover.start_offload() if direction == "offload" else mover.start_reload()
    call_s = time.perf_counter() - t0
    busy_after_call = mover.busy
    steps = []
    while True:
        s0 = time.perf_counter()
        done = mover.poll()
        if done is not None:
            break
        eng.step()
        steps.append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    return {"call_ms": call_s * 1e3, "busy_after_call": busy_after_call, "steps_during": len(steps),
            "max_step_ms": max(steps, default=0.0) * 1e3, "mean_step_ms": statistics.fmean(steps) * 1e3 if steps else 0.0,
            "copy_ms": done.seconds * 1e3, "gbps": done.gbps, "wall_ms": wall * 1e3, "chunks": mover.chunks,
            "steps_ms": [round(x * 1e3, 2) for x in steps]}


def overlap_verdict(off: dict, on: dict, base_ms: float, chunk_bytes: int) -> tuple[str, str]:
    """PASS when decode steps ran during both moves and the median one stayed within 1.5x of a
    plain step: the loop never waited on the copy. The longest step is reported, not judged:
    check 7 finds stalls that have nothing to do with copies."""
    med = [statistics.median(r["steps_ms"]) if r["steps_ms"] else 0.0 for r in (off, on)]
    ran = off["steps_during"] > 0 and on["steps_during"] > 0
    status = "PASS" if ran and max(med) < 1.5 * base_ms else ("WARN" if ran else "FAIL")
    return status, (f"{off['steps_during']} decode steps ran during the offload, {on['steps_during']} during the reload; "
                    f"median step {med[0]:.2f} / {med[1]:.2f} ms during vs {base_ms:.2f} ms without; longest "
                    f"{max(off['max_step_ms'], on['max_step_ms']):.1f} ms; copy {off['copy_ms']:.1f} / {on['copy_ms']:.1f} ms, "
                    f"the moves took {off['wall_ms']:.0f} / {on['wall_ms']:.0f} ms in {off['chunks']} / {on['chunks']} "
                    f"chunks of <= {chunk_bytes >> 20} MiB")


def check_mover(args, device: str, cuda: bool) -> None:
    gb = args.draft_gb if cuda else args.cpu_draft_gb
    dtype = torch.bfloat16 if cuda else torch.float32
    eng = decode_engine(args, device)
    model = synthetic_draft(gb, dtype, device, small=not cuda)
    mover = DraftMover(model)
    nb = mover.nbytes
    RESULTS["draft_bytes"] = nb
    print(f"synthetic draft: {model.cfg.num_layers} layers, {nb / 1e9:.2f} GB {dtype}", flush=True)
    keep_busy(eng)
    timed_steps(eng, 5)  # warm-up
    base = timed_steps(eng, 20)
    alloc0 = torch.cuda.memory_allocated(device) if cuda else 0

    off = move_while_decoding(eng, mover, "offload")
    alloc_off = torch.cuda.memory_allocated(device) if cuda else 0
    on = move_while_decoding(eng, mover, "reload")
    alloc_on = torch.cuda.memory_allocated(device) if cuda else 0
    stop_all(eng)

    if cuda:
        pinned = all(h.is_pinned() for h in mover._host)
        report("pinned", "PASS" if pinned else "FAIL", f"{len(mover._host)} host buffers, pinned={pinned}")
        ok = off["busy_after_call"] and on["busy_after_call"]
        report("async", "PASS" if ok else "FAIL",
               f"start_offload returned in {off['call_ms']:.2f} ms of a {off['copy_ms']:.1f} ms copy, "
               f"start_reload in {on['call_ms']:.2f} ms of {on['copy_ms']:.1f} ms; copy still running after the call: "
               f"{off['busy_after_call']}/{on['busy_after_call']}", offload=off, reload=on)
        b = statistics.median(base) * 1e3
        report("overlap", *overlap_verdict(off, on, b, mover.chunk_bytes), base_step_ms=b)
        freed = alloc0 - alloc_off
        back = alloc_on - alloc_off
        ok = abs(freed - nb) < 0.02 * nb + (64 << 20) and abs(back - nb) < 0.02 * nb + (64 << 20)
        report("freed", "PASS" if ok else "FAIL",
               f"allocated -{freed / 1e9:.3f} GB after offload, +{back / 1e9:.3f} GB after reload (draft {nb / 1e9:.3f} GB)")
    else:
        for name in ("pinned", "async", "overlap", "freed"):
            report(name, "SKIP", "no CUDA device: copies are synchronous on the CPU path "
                   f"(ran it: offload {off['copy_ms']:.1f} ms, reload {on['copy_ms']:.1f} ms for {nb / 1e6:.0f} MB)")

    fr = {}
    for d, r in (("offload", off), ("reload", on)):
        plain = plain_copy_seconds(nb, device, d, repeats=3)
        plain_gbps = nb / plain / 1e9
        fr[d] = {"gbps": r["gbps"], "plain_gbps": plain_gbps, "fraction": r["gbps"] / plain_gbps}
    status = "PASS" if not cuda or min(v["fraction"] for v in fr.values()) >= 0.5 else "WARN"
    report("bandwidth", status, "; ".join(f"{d} {v['gbps']:.1f} GB/s = {v['fraction']:.0%} of a plain pinned copy "
                                          f"({v['plain_gbps']:.1f} GB/s)" for d, v in fr.items()), **fr)


def check_stalls(args, device: str, cuda: bool) -> None:
    if not cuda:
        report("stalls", "SKIP", "no CUDA device")
        return
    eng = decode_engine(args, device)
    keep_busy(eng)
    timed_steps(eng, 5)
    out = {}
    for label, on in (("cudnn_sdp_on", True), ("cudnn_sdp_off", False), ("cudnn_sdp_on_again", True)):
        torch.backends.cuda.enable_cudnn_sdp(on)
        t = timed_steps(eng, 64)  # 4 new KV lengths (64 tokens / 16 per block) for every sequence
        med = statistics.median(t)
        slow = [i for i, x in enumerate(t) if x > 3 * med]
        out[label] = {"median_ms": med * 1e3, "max_ms": max(t) * 1e3, "stall_steps": slow}
    torch.backends.cuda.enable_cudnn_sdp(True)
    stop_all(eng)
    status = "PASS" if not out["cudnn_sdp_on"]["stall_steps"] else "WARN"
    report("stalls", status, "; ".join(f"{k}: median {v['median_ms']:.2f} ms, max {v['max_ms']:.1f} ms, "
                                       f"{len(v['stall_steps'])} steps > 3x median" for k, v in out.items()), **out)


def run_generation(eng: Engine, prompts, cycles: bool) -> dict[str, list[int]]:
    eng.set_gamma_policy((lambda b: 3) if cycles else (lambda b: 0))
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"g{i}", p, SamplingParams(max_tokens=64)))
    out: dict[str, list[int]] = {}
    step, peak = 0, []
    while eng.has_unfinished():
        if cycles and step in (2, 8):
            if eng.memory.mover.cuda:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if eng.memory.mover.cuda else 0
            eng.set_draft_residency("offloaded")
            eng.memory.wait()  # check only: finish now so the grow's transient is measured here
            if eng.memory.mover.cuda:
                peak.append(torch.cuda.max_memory_allocated() - before)
        if cycles and step in (5, 11):
            eng.set_draft_residency("resident")
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    if cycles:
        eng.set_draft_residency("resident")
        eng.memory.wait()
        RESULTS["kv_grow_transient_bytes"] = peak
    return out


def check_identity(args, device: str) -> None:
    eng = Engine(EngineConfig(target_path=args.target, draft_path=args.draft, device=device, dtype="float32",
                              kv_budget_bytes=32 << 20, num_threads=None if device != "cpu" else 1))
    texts = [json.loads(x)["text"] for x in (ROOT / "models" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    prompts = [eng.tokenizer(t, add_special_tokens=False)["input_ids"][:40] or [1] for t in texts[:16]]
    plain = run_generation(eng, prompts, cycles=False)
    elastic = run_generation(eng, prompts, cycles=True)
    rep = eng.memory.report()
    same = sum(plain[k] == elastic[k] for k in plain)
    first = {k: next((i for i, (a, b) in enumerate(zip(plain[k], elastic[k])) if a != b), None) for k in plain
             if plain[k] != elastic[k]}
    ok = rep.offloads >= 2 and rep.reloads >= 2
    status = "PASS" if same == len(plain) and ok else ("WARN" if ok else "FAIL")
    report("identity", status, f"{same}/{len(plain)} greedy outputs identical to plain decoding across "
           f"{rep.offloads} offloads / {rep.reloads} reloads (refusals {rep.refusals}, migrated "
           f"{rep.last_migrated_blocks} blocks last squeeze); first divergences {first or 'none'} "
           "(WARN = float near-ties between batch shapes, not necessarily a bug)",
           kv_grow_transient_bytes=RESULTS.get("kv_grow_transient_bytes"),
           target_pool_bytes=rep.parts.target_kv)


def main(argv: list[str] | None = None) -> int:
    """Checks:
      1. pinned:    the host buffers of an offloaded draft are pinned (page-locked) memory.
      2. async:     start_offload / start_reload return before the copy is done (the copy runs on
                    a side stream; the engine only polls an event).
      3. overlap:   a decode loop keeps stepping while a large draft (--draft-gb, synthetic
                    Llama-shaped weights) moves in paced chunks; the median step during the move
                    stays within 1.5x of a plain step (the loop never waited on the copy).
      4. bandwidth: offload / reload GB/s against one plain pinned copy of the same bytes.
      5. freed:     torch.cuda.memory_allocated drops by the draft's bytes after an offload and
                    comes back after the reload; the KV resize's transient peak is reported.
      6. identity:  greedy outputs of 16 concurrent requests with offload/reload cycles issued
                    mid-generation (speculation on) vs the same engine decoding plainly.
      7. stalls:    decode steps over 3x the median while sequences grow, with cuDNN's attention
                    backend on (torch's choice) and off. A slow step came each time the sequences'
                    KV entered a new block, i.e. a new attention shape (BENCHMARKS.md, "On a GPU
                    (NVIDIA H200)"): the suspect is a per-shape plan build in cuDNN's SDPA. This
                    check tells."""
    ap = argparse.ArgumentParser(description=__doc__, epilog=inspect.getdoc(main),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(paths.DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(paths.DEFAULT_DRAFT))
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the decode engine in the overlap check")
    ap.add_argument("--draft-gb", type=float, default=2.0, help="synthetic draft size on CUDA (a 1B draft in bf16)")
    ap.add_argument("--cpu-draft-gb", type=float, default=0.05, help="synthetic draft size on the CPU path")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        args.dtype = "float32"
        print("CUDA is not available: the CUDA-only checks are SKIPPED; the same code paths run on the CPU.")
    RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
                      "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    print(f"torch {torch.__version__}, device {RESULTS['env']['device']}", flush=True)
    for fn in (check_mover, check_identity, check_stalls):
        try:
            fn(args, device) if fn is check_identity else fn(args, device, cuda)
        except Exception as exc:  # one failing check must not hide the others' results
            report(fn.__name__, "FAIL", f"{type(exc).__name__}: {exc}")
            import traceback

            traceback.print_exc()
    out = args.json or (os.path.join(os.environ["OUT"], "device_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1, default=str))
        print(f"wrote {out}")
    failed = [k for k, v in RESULTS["checks"].items() if v["status"] == "FAIL"]
    print("FAILED: " + ", ".join(failed) if failed else "no check failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
