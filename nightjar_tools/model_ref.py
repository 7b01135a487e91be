"""MODEL as `nightjar serve` takes it: a local checkpoint folder, or a Hugging Face hub id that
resolves to a snapshot already in the local cache (HF_HUB_CACHE / HF_HOME). Nothing is
downloaded: serving must not depend on the network; fetch models beforehand with `hf download`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> str:
    """The hub cache folder, read now: huggingface_hub reads its environment once, at import,
    and transformers may have imported it before a caller (a test) set HF_HUB_CACHE."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve(model: str, flag: str = "MODEL") -> Path:
    """The checkpoint folder ``model`` names, or ValueError saying how to provide it."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {model}: the folder has no config.json; point it at a Hugging Face checkpoint folder")
        return path.resolve()
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"{flag} {model}: not a checkpoint folder, and not a hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_dir()
    try:
        folder = Path(snapshot_download(model, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as exc:
        raise ValueError(f"{flag} {model}: not a local folder and not in the Hugging Face cache "
                         f"({cache}); fetch it first with `hf download {model}` "
                         f"({type(exc).__name__})") from None
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {model}: the cached snapshot {folder} has no config.json")
    return folder
