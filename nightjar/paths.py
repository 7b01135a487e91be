"""Where the shipped models and prompt set live (overridable by each service's config).

Two pairs ship: ``serve-*``, serving-shaped (a few wide layers that stream their weights, as an
8B/1B pair does), the default; and ``tiny-*``, small and quick, which the tests run.
``NIGHTJAR_DEFAULT_PAIR=tiny`` makes the tiny pair the default (tests/conftest.py sets it).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "models"
SERVE_TARGET, SERVE_DRAFT = MODELS_DIR / "serve-target", MODELS_DIR / "serve-draft"
TINY_TARGET, TINY_DRAFT = MODELS_DIR / "tiny-target", MODELS_DIR / "tiny-draft"
PAIRS = {"serve": (SERVE_TARGET, SERVE_DRAFT), "tiny": (TINY_TARGET, TINY_DRAFT)}
PAIR_ENV = "NIGHTJAR_DEFAULT_PAIR"
_pair = os.environ.get(PAIR_ENV, "serve")
if _pair not in PAIRS:
    raise SystemExit(f"{PAIR_ENV}={_pair!r}: expected one of {', '.join(PAIRS)}")
DEFAULT_TARGET, DEFAULT_DRAFT = PAIRS[_pair]
# The shipped pairs' offline cost surfaces (scripts/bench_speculation.py: CPU, float32, one torch
# thread): the planner's default prior when that pair serves on CPU. Another CPU's steps take
# longer or shorter, but the shape (the best γ falling with the batch) carries over, and live
# steps replace the prior's figures cell by cell.
COST_SURFACES = ROOT / "planner_svc" / "cost_surfaces"
SHIPPED_SURFACES = {SERVE_TARGET: COST_SURFACES / "cpu_serve.json", TINY_TARGET: COST_SURFACES / "cpu_tiny.json"}


def cost_surface(name_or_path: str) -> Path | None:
    """``--prior-surface``'s value as a file: ``none`` (no prior), the name of a shipped surface
    (``cpu_serve``: planner_svc/cost_surfaces/cpu_serve.json, in a checkout or an installed
    image), or a path."""
    if name_or_path.lower() == "none":
        return None
    shipped = COST_SURFACES / f"{name_or_path}.json"
    return shipped if "/" not in name_or_path and shipped.is_file() else Path(name_or_path)


def shipped_surface(target: Path, device: str = "cpu", dtype: str = "float32") -> Path | None:
    """The cost surface shipped for ``target`` served on ``device`` in ``dtype``, if there is one."""
    if device != "cpu" or dtype != "float32":
        return None
    resolved = Path(target).resolve()
    return next((s for t, s in SHIPPED_SURFACES.items() if t.resolve() == resolved), None)


HELDOUT_PROMPTS = MODELS_DIR / "prompts.jsonl"  # one {"id": str, "text": str} per line
TRACES_DIR = ROOT.parent / "shared" / "traces"  # read by path, never copied in
