"""OpenAI HTTP vs gRPC through the same stack: TTFT and tokens/s at 1 and 32 concurrent streams.

    .venv/bin/python scripts/bench_http.py [--rounds 3] [--max-tokens 32] [--concurrency 1 32]

One stack serves both front ends, in interleaved rounds so that load from elsewhere hits both
alike; prints a markdown table. The method, and why the default HTTP client is a raw socket:
``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from nightjar import paths  # noqa: E402


def prompts(n: int, chars: int) -> list[str]:
    texts = [json.loads(line)["text"][:chars] for line in paths.HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    texts = [t for t in texts if t.strip()]
    return [texts[i % len(texts)] for i in range(n)]


async def grpc_stream(stub, prompt: str, max_tokens: int) -> tuple[float, int]:
    from nightjar.v1 import inference_pb2 as pb

    t0, ttft, n = time.perf_counter(), None, 0
    async for resp in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)):
        if resp.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(resp.token_ids)
    return ttft, n


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


class SSEClock:
    """Reads one stream's SSE events: the time to the first text, and the usage's token count."""

    def __init__(self) -> None:
        self.t0, self.ttft, self.tokens = time.perf_counter(), None, 0

    def event(self, line: str | bytes) -> None:
        if isinstance(line, bytes):
            line = line.decode()
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        elif self.ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
            self.ttft = time.perf_counter() - self.t0


async def http_stream(client, prompt: str, max_tokens: int) -> tuple[float, int]:
    clock = SSEClock()
    async with client.stream("POST", "/completions", json=completion_body(prompt, max_tokens)) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            clock.event(line)
    return clock.ttft, clock.tokens


class RawHTTP:
    """A pool of kept-alive HTTP/1.1 connections that POST one body and read a chunked SSE reply."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host, self.port, self.path = u.hostname, u.port, u.path.rstrip("/") + "/completions"
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def stream(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        body = json.dumps(completion_body(prompt, max_tokens)).encode()
        head = (f"POST {self.path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        clock = SSEClock()
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        writer.write(head + body)
        status = await reader.readline()
        assert b" 200 " in status, status
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers: uvicorn streams with chunked transfer encoding
        buf = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            buf += await reader.readexactly(size)
            await reader.readexactly(2)
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                clock.event(event)
        self.idle.append((reader, writer))
        return clock.ttft, clock.tokens


async def one_round(kind: str, clients, texts: list[str], max_tokens: int) -> tuple[list[float], float]:
    stub, http = clients
    t0 = time.perf_counter()
    if kind == "gRPC":
        results = await asyncio.gather(*(grpc_stream(stub, t, max_tokens) for t in texts))
    elif isinstance(http, RawHTTP):
        results = await asyncio.gather(*(http.stream(t, max_tokens) for t in texts))
    else:
        results = await asyncio.gather(*(http_stream(http, t, max_tokens) for t in texts))
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in results)
    assert tokens == max_tokens * len(texts), f"{kind}: {tokens} tokens, expected {max_tokens * len(texts)}"
    return [ttft for ttft, _ in results], tokens / wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(a: argparse.Namespace, stack) -> list[str]:
    import grpc
    import httpx

    from nightjar.v1 import inference_pb2_grpc as pb_grpc

    rows = ["| streams | front end | TTFT p50 ms | TTFT p90 ms | tokens/s (median of rounds) | HTTP / gRPC tokens/s |",
            "|---:|---|---:|---:|---:|---:|"]
    limits = httpx.Limits(max_connections=max(a.concurrency) + 4, max_keepalive_connections=max(a.concurrency) + 4)
    async with grpc.aio.insecure_channel(stack.address) as channel, \
            httpx.AsyncClient(base_url=stack.http_url, timeout=120, limits=limits) as http:
        clients = (pb_grpc.InferenceServiceStub(channel), RawHTTP(stack.http_url) if a.client == "raw" else http)
        await one_round("gRPC", clients, prompts(2, a.chars), 4)  # warm both paths (connections, first compile)
        await one_round("HTTP", clients, prompts(max(a.concurrency), a.chars), 4)  # opens every connection once
        for c in a.concurrency:
            texts = prompts(c, a.chars)
            ttfts: dict[str, list[float]] = {"gRPC": [], "HTTP": []}
            rates: dict[str, list[float]] = {"gRPC": [], "HTTP": []}
            for r in range(a.rounds):
                for kind in (("gRPC", "HTTP") if r % 2 == 0 else ("HTTP", "gRPC")):
                    t, rate = await one_round(kind, clients, texts, a.max_tokens)
                    ttfts[kind] += t
                    rates[kind].append(rate)
                    print(f"  {c:>3} streams, round {r + 1}, {kind}: {rate:.0f} tok/s, TTFT p50 {pct(t, 0.5) * 1000:.1f} ms",
                          file=sys.stderr, flush=True)
            base = statistics.median(rates["gRPC"])
            for kind in ("gRPC", "HTTP"):
                rate = statistics.median(rates[kind])
                ratio = f"{rate / base:.2f}" if kind == "HTTP" else ""
                rows.append(f"| {c} | {kind} | {pct(ttfts[kind], 0.5) * 1000:.1f} | {pct(ttfts[kind], 0.9) * 1000:.1f} "
                            f"| {rate:.0f} | {ratio} |")
    return rows


def main() -> int:
    """One stack (shipped pair, policy ``off`` unless --policy says otherwise, so γ does not drift
    between rounds) serves both front ends. Rounds are interleaved (gRPC, HTTP, then HTTP, gRPC
    ...) so that load from elsewhere hits both alike. Every stream is a greedy completion of
    exactly ``--max-tokens`` tokens (ignore_eos). Clients: grpc.aio for gRPC (its C core); for
    HTTP ``--client raw`` (default) writes a prebuilt HTTP/1.1 request on a kept-alive socket and
    reads the chunked SSE itself, and ``--client httpx`` uses httpx. The raw client costs about
    what grpc.aio's does per stream; httpx's own Python per request and per chunk, run for 32
    streams on the event loop that also times them, shows up as TTFT of the server's. TTFT is
    client-side (request sent -> first token); tokens/s is all completion tokens of a round over
    its wall time."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--chars", type=int, default=200, help="prompt length in characters")
    p.add_argument("--policy", default="off")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--client", choices=("raw", "httpx"), default="raw", help="the HTTP client (see above)")
    a = p.parse_args()
    from nightjar_tools.stack import Stack, StackConfig

    cfg = StackConfig(port=0, http_port=0, workers=a.workers, key_prefix=f"bh{uuid.uuid4().hex[:6]}", policy=a.policy)
    with Stack(cfg) as stack:
        rows = asyncio.run(run(a, stack))
    print(f"\n`scripts/bench_http.py --rounds {a.rounds} --max-tokens {a.max_tokens} --concurrency "
          f"{' '.join(map(str, a.concurrency))} --client {a.client}` (policy {a.policy}, {a.workers} worker, "
          f"{os.cpu_count()} cores)\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
