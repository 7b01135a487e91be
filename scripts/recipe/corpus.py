"""The training corpus: the Python standard library's source and docs, split by file.

Every machine with this Python has the same files, so the corpus needs no download. The split is
by file (a hash of the relative path and the seed), so no held-out prompt shares a file with
training text.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class CorpusSpec:
    root: Path = DEFAULT_STDLIB
    seed: int = 1234
    heldout_percent: int = 3  # of files, chosen by hash: ~1 MB of held-out text
    max_file_bytes: int = 400_000  # skips nothing today; guards against a stray data dump

    def __post_init__(self) -> None:
        if not self.root.is_dir():
            raise ValueError(f"corpus root {self.root} is not a directory; pass --stdlib PATH")
        if not 0 < self.heldout_percent < 50:
            raise ValueError("heldout_percent must be in 1..49")


def _bucket(rel: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100


def list_files(spec: CorpusSpec) -> tuple[list[Path], list[Path]]:
    """Return (train_files, heldout_files), each sorted by relative path."""
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(spec.root.rglob("*.py")):
        rel = path.relative_to(spec.root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or "/__pycache__/" in rel:
            continue
        if path.stat().st_size > spec.max_file_bytes and rel != "pydoc_data/topics.py":
            continue
        (heldout if _bucket(rel, spec.seed) < spec.heldout_percent else train).append(path)
    if not train or not heldout:
        raise ValueError(f"no .py files split from {spec.root}; is it a Python stdlib directory?")
    return train, heldout


def read_text(path: Path) -> str:
    # A few test files hold invalid UTF-8 on purpose; dropping them keeps round-trips exact.
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""
    return text.replace(EOS_TOKEN, "")


def read_documents(paths: list[Path]) -> list[str]:
    return [t for t in (read_text(p) for p in paths) if t.strip()]
