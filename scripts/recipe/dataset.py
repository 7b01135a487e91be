"""Token streams for training and evaluation: each document's ids followed by EOS, concatenated."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from .corpus import CorpusSpec, list_files, read_documents
from .shapes import EOS_ID


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """-> [n] int16 token ids (the vocabulary fits in 15 bits)."""
    out: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(EOS_ID)
    return torch.tensor(out, dtype=torch.int16)


def load_streams(tokenizer_dir: Path, spec: CorpusSpec, cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, heldout) streams, cached in cache_dir keyed by the seed."""
    cache = cache_dir / f"streams-seed{spec.seed}.pt"
    if cache.exists():
        saved = torch.load(cache)
        return saved["train"], saved["heldout"]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    train_files, heldout_files = list_files(spec)
    train = encode_stream(tok, read_documents(train_files))
    heldout = encode_stream(tok, read_documents(heldout_files))
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "heldout": heldout}, cache)
    return train, heldout
