"""Where the shipped models and prompt set live (overridable by each service's config)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "models"
DEFAULT_TARGET = MODELS_DIR / "tiny-target"
DEFAULT_DRAFT = MODELS_DIR / "tiny-draft"
HELDOUT_PROMPTS = MODELS_DIR / "prompts.jsonl"  # one {"id": str, "text": str} per line
TRACES_DIR = ROOT.parent / "shared" / "traces"  # read by path, never copied in
