"""``nightjar demo``: start the whole stack, stream one completion to stdout, stop.

The README's first command: embedded Redis, the shipped models, one worker, the planner;
the completion is printed token by token as it arrives, then its timings.
"""

from __future__ import annotations

import argparse
import sys
import time

from nightjar_tools.serve import add_stack_args, stack_config
from nightjar_tools.stack import Stack

# Not ending in indentation, which the tokenizer would split mid-token (tests/nightjar/test_models.py).
DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:'


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nightjar demo", description="start the stack, stream one completion, stop")
    add_stack_args(p, port=0)
    p.add_argument("--prompt", default=None, help="prompt text (default: a fixed code prompt)")
    p.add_argument("--max-tokens", type=int, default=96)
    # Sampled: greedy decoding of the 38M-parameter shipped target repeats lines and a sample
    # reads as code (models/README.md). Seeded, yet each γ schedule draws a different sample.
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = stack_config(a, p)
    prompt = a.prompt if a.prompt is not None else DEFAULT_PROMPT

    import grpc

    from nightjar.v1 import inference_pb2 as pb
    from nightjar.v1 import inference_pb2_grpc as pb_grpc

    t0 = time.perf_counter()
    print("nightjar demo: starting redis, scheduler, planner, worker, gateway ...", file=sys.stderr, flush=True)
    try:
        stack = Stack(cfg).start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"nightjar demo: the stack did not start: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"nightjar demo: ready on {stack.address} in {time.perf_counter() - t0:.1f}s\n", file=sys.stderr, flush=True)
        with grpc.insecure_channel(stack.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            sys.stdout.write(prompt)
            sys.stdout.flush()
            last = None
            for resp in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=a.max_tokens, temperature=a.temperature,
                                                         top_p=a.top_p, seed=a.seed), timeout=300):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        n = last.usage.completion_tokens
        decode_s = max(1e-9, (last.e2e_ms - last.ttft_ms) / 1000)
        print(f"\n\n[{info.model} (draft {info.draft_model or 'none'}), policy {cfg.policy}] "
              f"{last.usage.prompt_tokens} prompt + {n} completion tokens, finish {reason}; "
              f"TTFT {last.ttft_ms:.1f} ms, total {last.e2e_ms:.1f} ms, {max(0, n - 1) / decode_s:.1f} tokens/s after the first",
              flush=True)
        return 0
    except grpc.RpcError as exc:
        print(f"\nnightjar demo: request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("nightjar demo: stopped", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
