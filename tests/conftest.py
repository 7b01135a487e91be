"""Shared fixtures and the model material every room's tests use. Integration tests use a real
redis-server (never fakeredis).

Model caches are per process (functools.cache): one set of random checkpoints, one transformers
reference per model and one engine per configuration per session (loading is what costs).
NEAR_TIE: at the first divergence from the transformers reference, a greedy comparison passes
only if the reference's top-2 logits there differ by at most NEAR_TIE, and stops there.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from nightjar.keys import Keys
from nightjar.messages import OutputChunk

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests run the small pair wherever they rely on the default one (nightjar/paths.py); the
# serving pair's own tests name it explicitly.
os.environ.setdefault("NIGHTJAR_DEFAULT_PAIR", "tiny")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

torch.set_num_threads(1)  # the CI box has 2 shared cores; oversubscribed OpenMP threads are 10-100x slower

NEAR_TIE = 1e-3  # top-2 logit gap (absolute, float32) under which a divergence is a tie, not a bug
SHIPPED_TARGET = ROOT / "models" / "tiny-target"
SHIPPED_DRAFT = ROOT / "models" / "tiny-draft"
PROMPTS = ROOT / "models" / "prompts.jsonl"


@functools.cache
def random_models() -> dict[str, Path]:
    from make_random_models import make_all

    out = Path(tempfile.mkdtemp(prefix="nightjar-random-models-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return make_all(out)


def shipped_available() -> bool:
    return all((p / "config.json").is_file() and any(p.glob("*.safetensors")) for p in (SHIPPED_TARGET, SHIPPED_DRAFT))


def pair() -> tuple[str, str]:
    """(target, draft): the shipped pair when it exists, else the random Llama pair."""
    if shipped_available():
        return str(SHIPPED_TARGET), str(SHIPPED_DRAFT)
    m = random_models()
    return str(m["llama-target"]), str(m["llama-draft"])


@functools.cache
def tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.cache
def prompt_ids(path: str, n: int, max_len: int = 48) -> tuple[tuple[int, ...], ...]:
    """n held-out prompts (models/prompts.jsonl) tokenized and cut to max_len tokens; with the
    random models (byte-level) the same texts work, so the prompts are always real text."""
    tok = tokenizer(path)
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    out = []
    for t in texts[:n]:
        ids = tok(t, add_special_tokens=False)["input_ids"][:max_len]
        out.append(tuple(ids) if ids else (0,))
    return tuple(out)


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> tuple[tuple[int, ...], tuple[tuple[float, float], ...]]:
    """transformers generate(do_sample=False): (tokens without a final EOS, top-2 logits per step)."""
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(prompt):].tolist()
    top2 = tuple(tuple(lg[0].float().topk(2).values.tolist()) for lg in out.logits)
    eos = set(engine_eos(path))
    if toks and toks[-1] in eos:
        toks = toks[:-1]
    return tuple(toks), top2


@functools.cache
def engine_eos(path: str) -> tuple[int, ...]:
    from worker.engine.loader import load_config

    ids = set(load_config(path).eos_token_ids)
    if tokenizer(path).eos_token_id is not None:
        ids.add(tokenizer(path).eos_token_id)
    return tuple(ids)


def check_greedy(ref: tuple[tuple[int, ...], tuple], got: list[int]) -> str | None:
    """None if ``got`` equals the reference up to an allowed near-tie; else what differs."""
    ref_toks, top2 = ref
    for i, (a, b) in enumerate(zip(ref_toks, got)):
        if a != b:
            gap = top2[i][0] - top2[i][1]
            if gap <= NEAR_TIE:
                return None
            return f"diverged at {i}: ref {a} got {b}, reference top-2 gap {gap:.2e} > {NEAR_TIE}"
    if len(ref_toks) != len(got):
        return f"lengths differ: ref {len(ref_toks)} got {len(got)}"
    return None


@functools.cache
def engine(target: str, draft: str | None = None, **kw):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    return Engine(EngineConfig(target_path=target, draft_path=draft, **kw))


def run_all(eng, requests, arrive_every: int = 0, on_step=None) -> dict[str, list[int]]:
    """Feed requests (staggered: one more every ``arrive_every`` steps; 0 = all at once) and
    step until done. -> request_id -> completion tokens; asserts indices are contiguous."""
    pending = list(requests)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while pending or eng.has_unfinished():
        if pending and (arrive_every == 0 or step % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for r in batch:
                eng.add_request(r)
            pending = pending[len(batch):]
        if on_step is not None:
            on_step(eng, step)
        for o in eng.step():
            got = out.setdefault(o.request_id, [])
            assert o.index == len(got), f"{o.request_id}: index {o.index} != {len(got)} already emitted"
            got.extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        step += 1
        assert step < 100_000
    run_all.reasons = reasons
    return out


async def read_until_final(redis_client, keys: Keys, rid: str, timeout_s: float = 60.0) -> list:
    """Every OutputChunk of request ``rid`` up to its final one; a Redis error (a BUSY script,
    a restart) is waited out, not raised, until ``timeout_s``."""
    chunks, last = [], b"0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = await redis_client.xread({keys.output(rid): last}, block=200)
        except redis.RedisError:
            await asyncio.sleep(0.2)
            continue
        for _, entries in reply or ():
            for entry_id, fields in entries:
                last = entry_id
                chunks.append(OutputChunk.decode(fields[b"c"]))
                if chunks[-1].finish_reason is not None:
                    return chunks
    raise AssertionError(f"{rid}: no final chunk within {timeout_s}s")


@pytest.fixture(scope="session")
def redis_server():
    from nightjar_tools.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test, so tests sharing the server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real 3-primary Redis Cluster (tests/redis_cluster.py), shared by the session: tests
    give their keys a fresh hash-tag prefix and ask it which node owns their slot."""
    from tests.redis_cluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.slow)])
def any_redis(request, key_prefix) -> tuple[str, str]:
    """(URL, key prefix): one redis-server, then the session's Redis Cluster through a
    ``redis+cluster://`` URL whose only seed node does not own the prefix's slot (so every
    command is routed) and a hash-tag prefix. A test taking it runs against both."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url"), key_prefix
    cluster = request.getfixturevalue("cluster")
    prefix = "{" + key_prefix + "}"
    owner = cluster.owner(Keys(prefix).requests)
    return f"redis+cluster://127.0.0.1:{next(p for p in cluster.ports if p != owner)}", prefix
