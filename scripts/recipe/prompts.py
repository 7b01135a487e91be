"""The held-out prompt set (models/prompts.jsonl): spans of held-out files, 8-400 tokens long.

Lengths are log-uniform so short chat-like prompts and long ones are both common; every prompt
starts at a line start and round-trips through the tokenizer byte-exactly.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from tokenizers import Tokenizer

from .corpus import CorpusSpec, list_files, read_documents


def build_prompts(tok: Tokenizer, spec: CorpusSpec, count: int = 300, min_tokens: int = 8,
                  max_tokens: int = 400) -> list[dict[str, str]]:
    _, heldout_files = list_files(spec)
    docs = read_documents(heldout_files)
    rng = random.Random(spec.seed)
    weights = [len(d) for d in docs]
    prompts: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(prompts) < count:
        doc = rng.choices(docs, weights=weights)[0]
        want = round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
        lines = doc.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        chunk = "".join(lines[start:start + want])  # a line is >= 1 token, so this is enough
        ids = tok.encode(chunk, add_special_tokens=False).ids[:want]
        text = tok.decode(ids, skip_special_tokens=False)
        if len(ids) < min_tokens or not text.strip() or "\ufffd" in text or text in seen:
            continue
        if tok.decode(tok.encode(text, add_special_tokens=False).ids) != text:
            continue
        seen.add(text)
        prompts.append({"id": f"heldout-{len(prompts):04d}", "text": text})
    return prompts


def write_prompts(prompts: list[dict[str, str]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")


def read_prompts(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
