"""Pipeline overhead: the same requests through the whole stack vs the engine in-process.

    .venv/bin/python scripts/bench_pipeline.py [--streams 32] [--max-tokens 32] [--rounds 3]
    .venv/bin/python scripts/bench_pipeline.py --hops 40     # where the added TTFT goes

What the stack adds to TTFT (goal <= 5 ms) and what it keeps of the engine's throughput (goal
>= 0.95), in rounds that alternate so load from elsewhere hits both alike. The modes: ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from nightjar import paths  # noqa: E402


def prompts(n: int, chars: int) -> list[str]:
    import json

    texts = [json.loads(line)["text"][:chars] for line in paths.HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    return [t for t in texts if t.strip()][:n]


class InProcess:
    """The engine driven directly, as a caller without the pipeline would."""

    def __init__(self, target: Path, draft: Path | None, threads: int, gamma: int, device: str = "cpu") -> None:
        from worker.engine.config import EngineConfig
        from worker.engine.engine import Engine

        self.eng = Engine(EngineConfig(target_path=str(target), draft_path=str(draft) if draft else None,
                                       num_threads=threads, default_gamma=gamma if draft else 0, device=device))
        self.tok = self.eng.tokenizer
        self.n = 0

    def _req(self, text: str, max_tokens: int):
        from nightjar.messages import SamplingParams
        from worker.engine.engine import EngineRequest

        self.n += 1
        return EngineRequest(f"b{self.n}", self.tok.encode(text), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def ttft_ms(self, text: str, max_tokens: int) -> float:
        t0 = time.perf_counter()
        self.eng.add_request(self._req(text, max_tokens))
        first = None
        while self.eng.has_unfinished():
            for o in self.eng.step():
                if first is None and o.new_token_ids:
                    first = time.perf_counter()
        return (first - t0) * 1000

    def throughput(self, texts: list[str], max_tokens: int) -> float:
        t0 = time.perf_counter()
        for t in texts:
            self.eng.add_request(self._req(t, max_tokens))
        tokens, steps, step_s = 0, 0, 0.0
        while self.eng.has_unfinished():
            s0 = time.perf_counter()
            tokens += sum(len(o.new_token_ids) for o in self.eng.step())
            steps, step_s = steps + 1, step_s + time.perf_counter() - s0
        self.last_round = (steps, step_s * 1000, (time.perf_counter() - t0) * 1000)  # steps, ms in steps, ms wall
        return tokens / (time.perf_counter() - t0)


class EngineProcess:
    """InProcess in a child process of its own, so that the engine side runs in a process
    as bare as a worker's (no gRPC client, no event loop) and gets the CPU the same way."""

    def __init__(self, draft: Path | None, threads: int, gamma: int, device: str) -> None:
        import subprocess

        args = [sys.executable, __file__, "--engine-child", "--threads", str(threads), "--gamma", str(gamma),
                "--device", device]
        if draft is None:
            args.append("--no-draft")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout.readline().strip() == "ready"

    def _ask(self, **req):
        import json

        self.proc.stdin.write(json.dumps(req) + "\n")
        return json.loads(self.proc.stdout.readline())

    def ttft_ms(self, text: str, max_tokens: int) -> float:
        return self._ask(op="ttft", text=text, max_tokens=max_tokens)

    def throughput(self, texts: list[str], max_tokens: int) -> float:
        tps, *self.last_round = self._ask(op="tput", texts=texts, max_tokens=max_tokens)
        return tps

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def engine_child(a: argparse.Namespace) -> None:
    import json

    local = InProcess(paths.DEFAULT_TARGET, None if a.no_draft else paths.DEFAULT_DRAFT, a.threads, a.gamma, a.device)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "ttft":
            print(local.ttft_ms(req["text"], req["max_tokens"]), flush=True)
        else:
            print(json.dumps([local.throughput(req["texts"], req["max_tokens"]), *local.last_round]), flush=True)


class ThroughStack:
    def __init__(self, address: str) -> None:
        import grpc

        from nightjar.v1 import inference_pb2 as pb
        from nightjar.v1 import inference_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.InferenceServiceStub(self.channel)

    async def _one(self, text: str, max_tokens: int) -> tuple[float | None, int]:
        t0 = time.perf_counter()
        first, n = None, 0
        async for resp in self.stub.Generate(self.pb.GenerateRequest(prompt=text, max_tokens=max_tokens, ignore_eos=True)):
            if first is None and resp.token_ids:
                first = time.perf_counter()
            n += len(resp.token_ids)
        return (first - t0) * 1000, n

    async def ttft_ms(self, text: str, max_tokens: int) -> float:
        return (await self._one(text, max_tokens))[0]

    async def throughput(self, texts: list[str], max_tokens: int) -> float:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._one(t, max_tokens) for t in texts))
        return sum(n for _, n in results) / (time.perf_counter() - t0)


def stack_policy(a: argparse.Namespace) -> str:
    return f"fixed:{a.gamma}" if a.gamma else "off"


def start_stack(a: argparse.Namespace):
    """One worker, no planner, the engine settings of the in-process side."""
    from nightjar_tools.stack import Stack, StackConfig

    return Stack(StackConfig(port=0, workers=1, planner=False, policy=stack_policy(a),
                             draft_path=None if a.no_draft else paths.DEFAULT_DRAFT,
                             worker_threads=a.threads, io_nice=a.io_nice, log_level="WARNING", worker_args=("--device", a.device, *a.worker_arg),
                             gateway_args=("--no-direct-dispatch",) if a.via_scheduler else ())).start()


async def hops(a: argparse.Namespace) -> None:
    import threading

    import redis

    from nightjar.keys import Keys

    texts = prompts(a.hops, a.prompt_chars)
    stack = start_stack(a)
    keys = Keys(stack.cfg.key_prefix)
    events: list[tuple[float, str]] = []  # (unix time, command), appended by the MONITOR thread

    def monitor() -> None:
        try:
            with redis.Redis.from_url(stack.redis_url).monitor() as m:
                for ev in m.listen():
                    events.append((ev["time"], ev["command"][:24]))
        except redis.ConnectionError:
            pass  # the stack stopped

    threading.Thread(target=monitor, daemon=True).start()
    marks = []
    try:
        remote = ThroughStack(stack.address)
        await remote.ttft_ms(texts[0], 2)
        for t in texts:
            sent = time.time()
            async for resp in remote.stub.Generate(remote.pb.GenerateRequest(prompt=t, max_tokens=1, ignore_eos=True)):
                if resp.token_ids:
                    marks.append((sent, time.time()))
            await asyncio.sleep(0.05)  # one request at a time, as the TTFT comparison
        await remote.channel.close()
    finally:
        stack.stop()
    names = ("client -> job queued (gRPC in, validate, tokenize, enqueue)", "-> job in the inbox (scheduler, if it goes through it)",
             "-> first chunk written (worker: wake, engine step, write)", "-> first token at the client (gateway, gRPC out)")
    spans: list[list[float]] = [[] for _ in names]
    for sent, first in marks:
        seen = [(ts, cmd) for ts, cmd in events if sent <= ts <= first]
        # queued: the XADD to the requests stream, or the gateway's enqueue script (EVALSHA);
        # the worker's first chunk: its output script (EVAL + space, not EVALSHA)
        prefixes = ((f"XADD {keys.requests}", "EVALSHA"), (f"XADD {keys.inbox('')}",), ("EVAL ",))
        at = [next((ts for ts, cmd in seen if cmd.startswith(prefix)), None) for prefix in prefixes]
        if None in at:
            continue
        points = [sent, *at, first]
        for i in range(len(names)):
            spans[i].append((points[i + 1] - points[i]) * 1000)
    print(f"\nWhere the time to first token goes ({len(spans[0])} sequential 1-token requests, io_nice {a.io_nice}, "
          f"{'through the scheduler' if a.via_scheduler else 'direct dispatch'})\n")
    print("| hop | median ms | p90 ms |")
    print("|---|---:|---:|")
    for name, v in zip(names, spans):
        print(f"| {name} | {statistics.median(v):.2f} | {statistics.quantiles(v, n=10)[-1]:.2f} |")


async def run(a: argparse.Namespace) -> None:
    draft = None if a.no_draft else paths.DEFAULT_DRAFT
    policy = stack_policy(a)
    texts = prompts(max(a.streams, a.ttft_samples), a.prompt_chars)
    print(f"starting the stack (1 worker, policy {policy}, {a.threads} torch thread(s)) and the in-process engine ...", file=sys.stderr)
    stack = start_stack(a)
    try:
        local = EngineProcess(draft, a.threads, a.gamma, a.device)
        remote = ThroughStack(stack.address)
        await remote.ttft_ms(texts[0], 2)  # warm both paths (first gRPC call, first engine step)
        local.ttft_ms(texts[0], 2)
        eng_ttft, stk_ttft, eng_tps, stk_tps = [], [], [], []
        eng_rounds, stk_rounds = [], []  # (engine steps, ms inside them, ms wall) per throughput round
        for r in range(a.rounds):
            for t in texts[: a.ttft_samples]:
                eng_ttft.append(local.ttft_ms(t, 1))
                stk_ttft.append(await remote.ttft_ms(t, 1))
            batch = texts[: a.streams]
            eng_tps.append(local.throughput(batch, a.max_tokens))
            eng_rounds.append(local.last_round)
            t0 = time.perf_counter()
            since_ms = int(time.time() * 1000)
            stk_tps.append(await remote.throughput(batch, a.max_tokens))
            stk_rounds.append((*stack_steps(stack, since_ms), (time.perf_counter() - t0) * 1000))
            print(f"round {r + 1}/{a.rounds}: engine {eng_tps[-1]:.0f} tok/s, stack {stk_tps[-1]:.0f} tok/s", file=sys.stderr)
        await remote.channel.close()
        local.close()
    finally:
        stack.stop()
    added = [s - e for s, e in zip(stk_ttft, eng_ttft)]
    p50 = statistics.median
    ratio = p50(stk_tps) / p50(eng_tps)
    # Each round's two sides run back to back, so their ratio cancels the machine's drift
    # (how far it moves: BENCHMARKS.md, "Pipeline overhead").
    round_ratios = sorted(s / e for s, e in zip(stk_tps, eng_tps))
    print(f"\nPipeline overhead ({a.rounds} rounds, {a.ttft_samples} TTFT samples each, {a.streams} streams x {a.max_tokens} tokens, "
          f"policy {policy}, {a.device}, {a.threads} thread(s), io_nice {a.io_nice}, "
          f"{'through the scheduler' if a.via_scheduler else 'direct dispatch'}, cpu_count={os.cpu_count()})\n")
    print("| measure | engine in-process | through the stack | stack - engine / ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| TTFT p50, 1 request at a time | {p50(eng_ttft):.1f} ms | {p50(stk_ttft):.1f} ms | {p50(added):+.1f} ms | <= 5 ms |")
    print(f"| TTFT p90 | {statistics.quantiles(eng_ttft, n=10)[-1]:.1f} ms | {statistics.quantiles(stk_ttft, n=10)[-1]:.1f} ms | "
          f"{statistics.quantiles(added, n=10)[-1]:+.1f} ms (p90 of differences) | |")
    print(f"| TTFT p50 of each side | | | {p50(stk_ttft) - p50(eng_ttft):+.1f} ms (difference of the medians) | |")
    print(f"| tokens/s, {a.streams} concurrent streams (median of rounds) | {p50(eng_tps):.0f} | {p50(stk_tps):.0f} | {ratio:.3f}x | >= 0.95x |")
    print(f"| tokens/s ratio per round (stack ÷ engine, back to back) | | | median {p50(round_ratios):.3f}x "
          f"(range {round_ratios[0]:.2f}-{round_ratios[-1]:.2f}) | >= 0.95x |")
    # Where a stack round's extra time goes: more steps, slower steps, or time between steps.
    med = [[p50(r[i] for r in rounds) for i in range(3)] for rounds in (eng_rounds, stk_rounds)]
    slower = p50(s[1] / s[0] / (e[1] / e[0]) for s, e in zip(stk_rounds, eng_rounds))
    print(f"| engine steps per round (median) | {med[0][0]:.0f} | {med[1][0]:.0f} | | |")
    print(f"| ms per engine step (median of rounds) | {med[0][1] / med[0][0]:.1f} | {med[1][1] / med[1][0]:.1f} | "
          f"per round median {slower:.3f}x | |")
    print(f"| ms of a round outside engine steps (median) | {med[0][2] - med[0][1]:.0f} | {med[1][2] - med[1][1]:.0f} | | |")


def stack_steps(stack, since_ms: int) -> tuple[int, float]:
    """The stack's engine steps since ``since_ms`` and the ms spent inside them (the worker's StepStats)."""
    import redis

    from nightjar.keys import Keys
    from nightjar.messages import StepStats

    with redis.Redis.from_url(stack.redis_url) as r:
        stats = [StepStats.decode(f[b"s"]) for _, f in r.xrange(Keys(stack.cfg.key_prefix).stats, min=f"{since_ms}-0")]
    return len(stats), sum(s.step_ms for s in stats)


async def compare_dispatch(a: argparse.Namespace) -> None:
    """Direct dispatch against going through the scheduler: two stacks up at once, rounds
    interleaved (order alternating), so the machine's drift hits both alike."""
    texts = prompts(max(a.streams, a.ttft_samples), a.prompt_chars)
    stacks = {via: start_stack(argparse.Namespace(**{**vars(a), "via_scheduler": via})) for via in (False, True)}
    try:
        remotes = {via: ThroughStack(s.address) for via, s in stacks.items()}
        for r in remotes.values():
            await r.throughput(texts[: a.streams], a.max_tokens)
            await r.ttft_ms(texts[0], 1)
        tps: dict[bool, list[float]] = {False: [], True: []}
        ttft: dict[bool, list[float]] = {False: [], True: []}
        for i in range(a.compare_dispatch):
            order = (False, True) if i % 2 == 0 else (True, False)
            for via in order:
                tps[via].append(await remotes[via].throughput(texts[: a.streams], a.max_tokens))
            for t in texts[: a.ttft_samples]:
                for via in order:
                    ttft[via].append(await remotes[via].ttft_ms(t, 1))
                    await asyncio.sleep(0.02)  # one request at a time, as the TTFT comparison
            print(f"round {i + 1}/{a.compare_dispatch}: direct {tps[False][-1]:.0f} tok/s, via scheduler {tps[True][-1]:.0f}", file=sys.stderr)
    finally:
        for s in stacks.values():
            s.stop()
    p50 = statistics.median
    ratios = sorted(d / v for d, v in zip(tps[False], tps[True]))
    print(f"\nDirect dispatch vs through the scheduler ({a.compare_dispatch} interleaved rounds, {a.ttft_samples} TTFT samples each)\n")
    print("| measure | direct | via scheduler | direct − via / ratio |")
    print("|---|---|---|---|")
    print(f"| TTFT p50, 1 request at a time | {p50(ttft[False]):.2f} ms | {p50(ttft[True]):.2f} ms | "
          f"{p50([d - v for d, v in zip(ttft[False], ttft[True])]):+.2f} ms (p50 of paired differences) |")
    print(f"| tokens/s, {a.streams} streams (median of rounds) | {p50(tps[False]):.0f} | {p50(tps[True]):.0f} | "
          f"per round median {p50(ratios):.3f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}) |")


_NEIGHBOURS = {  # what runs on the other core while the engine decodes (pinned to core 0; the engine to core 1)
    "nothing": None,
    "a pure-Python spin loop": "while True: pass",
    "copying 8 MB buffers (cache-sized)": "import numpy as np\na=np.ones(2_000_000,np.float32);b=np.empty_like(a)\nwhile True: np.copyto(b,a)",
    "copying 64 MB buffers (memory)": "import numpy as np\na=np.ones(16_000_000,np.float32);b=np.empty_like(a)\nwhile True: np.copyto(b,a)",
}


def neighbour_load(a: argparse.Namespace) -> None:
    """The engine alone on one core, with different work on the other: what the stack's other
    processes cost the engine through the cores' shared cache and memory, not through the CPU."""
    import subprocess

    if (os.cpu_count() or 1) < 2:
        sys.exit("--neighbour-load needs two cores")
    os.sched_setaffinity(0, {1})
    local = InProcess(paths.DEFAULT_TARGET, None if a.no_draft else paths.DEFAULT_DRAFT, a.threads, a.gamma, a.device)
    texts = prompts(a.streams, a.prompt_chars)
    local.throughput(texts, a.max_tokens)
    tps: dict[str, list[float]] = {k: [] for k in _NEIGHBOURS}
    for i in range(a.neighbour_load):
        for name, code in _NEIGHBOURS.items():
            proc = None
            if code is not None:
                proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{0}})\n{code}"])
                time.sleep(0.5)
            try:
                tps[name].append(local.throughput(texts, a.max_tokens))
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
        print(f"round {i + 1}/{a.neighbour_load} done", file=sys.stderr)
    base = statistics.median(tps["nothing"])
    print(f"\nThe engine alone on core 1, {a.streams} streams x {a.max_tokens} tokens ({a.neighbour_load} rounds)\n")
    print("| on core 0 | engine tokens/s (median) | ÷ nothing |")
    print("|---|---|---|")
    for name, v in tps.items():
        print(f"| {name} | {statistics.median(v):.0f} | {statistics.median(v) / base:.3f}x |")


def main(argv: list[str] | None = None) -> int:
    """One run, side by side, alternating engine and stack rounds so that load from elsewhere hits
    both alike; the engine side runs in a bare child process of its own, like a worker's:
    - TTFT: single requests one at a time; the stack's time to first token (client-side, gRPC
      over loopback) minus the engine's (add_request -> first token, same thread). p50 of the
      difference is the pipeline's added TTFT (goal <= 5 ms).
    - Throughput: ``--streams`` concurrent greedy streams of exactly ``--max-tokens`` tokens
      (ignore_eos); completion tokens per second through the stack / in-process (goal >= 0.95).
    Both sides run the same engine settings (γ policy, torch threads) on the shipped models.
    ``--compare-dispatch N`` instead runs two stacks, with and without direct dispatch, round for
    round; ``--neighbour-load N`` runs the engine alone on one core next to different loads on the
    other (what the stack's other processes cost it through shared cache and memory).
    ``--hops N`` instead times N sequential 1-token requests hop by hop, from the client's clock and
    Redis ``MONITOR`` timestamps (same machine, same clock): client -> job queued (gateway),
    -> job in the worker's inbox (scheduler; 0 when the gateway dispatched it directly under the
    scheduler's lease), -> first output chunk written (worker, engine step included), -> first
    token at the client (gateway and gRPC back). ``--via-scheduler`` turns direct dispatch off."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ttft-samples", type=int, default=20)
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both the worker and the in-process engine")
    p.add_argument("--gamma", type=int, default=0, help="fixed γ on both sides (0 = plain decoding)")
    p.add_argument("--no-draft", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N], for the worker and the in-process engine alike")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable), e.g. --worker-arg=--engine-process")
    p.add_argument("--io-nice", type=int, default=0, help="the stack's io_nice (0 = every service at the engine's priority)")
    p.add_argument("--via-scheduler", action="store_true", help="turn the gateway's direct dispatch off")
    p.add_argument("--hops", type=int, default=0, help="time N sequential requests hop by hop instead (Redis MONITOR)")
    p.add_argument("--compare-dispatch", type=int, default=0, metavar="ROUNDS",
                   help="instead: direct dispatch vs through the scheduler, two stacks, interleaved rounds")
    p.add_argument("--neighbour-load", type=int, default=0, metavar="ROUNDS",
                   help="instead: the engine alone on one core with different loads on the other")
    p.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.engine_child:
        engine_child(a)
    elif a.compare_dispatch:
        asyncio.run(compare_dispatch(a))
    elif a.neighbour_load:
        neighbour_load(a)
    elif a.hops:
        asyncio.run(hops(a))
    else:
        asyncio.run(run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
