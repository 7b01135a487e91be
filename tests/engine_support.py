"""Shared, cached test material for the engine tests (models, engines, references, near-tie rule).

Caches are per process (functools.cache), so every engine test module in one pytest session
shares one set of random checkpoints, one transformers reference per model and one engine
per configuration — loading is what costs on 2 cores.

The near-tie rule (NEAR_TIE): greedy outputs are compared token by token to the transformers
reference; at the first divergence the comparison is accepted only if the reference's top-2
logits at that position differ by at most NEAR_TIE (absolute, in float32 logit units), and it
stops there (the contexts differ afterwards). Anything else is a failure.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

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
