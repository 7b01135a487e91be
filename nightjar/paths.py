"""Where the shipped models and prompt set live (overridable by each service's config).

Two pairs ship: ``serve-*``, serving-shaped (a few wide layers that stream their weights, as an
8B/1B pair does), the default; and ``tiny-*``, small and quick, which the tests run.
``NIGHTJAR_DEFAULT_PAIR=tiny`` makes the tiny pair the default (tests/conftest.py sets it).
"""

from __future__ import annotations

import json
import math
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
# thread): the planner's default prior when that pair serves on CPU. A pair has one surface per
# kind of CPU it was measured on (``cpu_serve.json``, ``cpu_serve_zen4.json``, ...), each naming
# its CPU in a "cpu" field (``cpu_signature``) and its L3 in "l3_kib" (``cpu_l3_kib``); the one
# measured on this kind of CPU is the prior (of several, the one whose L3 is nearest this one's),
# else the pair's first (``cpu_<pair>.json``). The crossover moves with the CPU (batch 32 on Zen 3,
# 8 on Zen 4), and live steps replace the prior's figures cell by cell.
COST_SURFACES = ROOT / "planner_svc" / "cost_surfaces"


def cpu_signature(cpuinfo: str | None = None) -> str:
    """This CPU's kind as the cost surfaces record it: the vendor and the widest vector unit,
    e.g. ``AuthenticAMD avx512`` (``cpuinfo``: /proc/cpuinfo's text; read when not given).
    The step's shape follows these two (the linear kernel's tiles are built per vector width,
    BENCHMARKS.md, "CPU linear path"); "" where /proc/cpuinfo is not there."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first processor's block is enough
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    vendor, flags = fields.get("vendor_id", ""), set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx")) if flag in flags), "")
    return f"{vendor} {isa}".strip()


def cpu_l3_kib(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The first CPU's L3 in KiB, from sysfs (``cache_dir``); None where there is none. Two CPUs
    of one signature step differently when one holds the target's weights in its L3 and the other
    streams them (BENCHMARKS.md, "An Intel Xeon with a 480 MiB L3")."""
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1, "M": 1024, "G": 1 << 20}.get(size[-1:])
        digits = size[:-1] if scale else size
        if digits.isdigit():
            return int(digits) * (scale or 1)
    return None


def cost_surface(name_or_path: str) -> Path | None:
    """``--prior-surface``'s value as a file: ``none`` (no prior), ``auto:PAIR`` (the surface
    shipped for that pair on this kind of CPU: ``shipped_surface``; for a planner, which does not
    know the models), the name of a shipped surface (``cpu_serve``: planner_svc/cost_surfaces/
    cpu_serve.json, in a checkout or an installed image), or a path."""
    if name_or_path.lower() == "none":
        return None
    if name_or_path.startswith("auto:"):
        pair = name_or_path.removeprefix("auto:")
        if pair not in PAIRS:
            raise ValueError(f"--prior-surface {name_or_path}: expected auto:PAIR with PAIR one of {', '.join(PAIRS)}")
        return pair_surface(pair)
    shipped = COST_SURFACES / f"{name_or_path}.json"
    return shipped if "/" not in name_or_path and shipped.is_file() else Path(name_or_path)


def pair_surface(pair: str, cpu: str | None = None, l3_kib: int | None = None) -> Path:
    """The surface shipped for the pair ``pair`` (a key of PAIRS): the one measured on this kind of
    CPU (``cpu``: a ``cpu_signature``; ``l3_kib``: its L3, which picks among surfaces of the same
    signature; this machine's if not given), else the pair's first."""
    cpu = cpu_signature() if cpu is None else cpu
    l3_kib = cpu_l3_kib() if l3_kib is None else l3_kib
    matches = []
    for path in sorted(COST_SURFACES.glob(f"cpu_{pair}*.json")):
        try:
            surface = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a broken extra surface must not stop the default one
        if cpu and surface.get("cpu") == cpu:
            theirs = surface.get("l3_kib")
            # how many times larger one L3 is than the other; unknown sizes rank last
            apart = abs(math.log(theirs / l3_kib)) if theirs and l3_kib else math.inf
            matches.append((apart, path))
    return min(matches)[1] if matches else COST_SURFACES / f"cpu_{pair}.json"


def shipped_surface(target: Path, device: str = "cpu", dtype: str = "float32", cpu: str | None = None,
                    l3_kib: int | None = None) -> Path | None:
    """The cost surface shipped for ``target`` served on ``device`` in ``dtype``, if there is one
    (``pair_surface`` of the shipped pair whose target it is)."""
    if device != "cpu" or dtype != "float32":
        return None
    resolved = Path(target).resolve()
    pair = next((name for name, (t, _) in PAIRS.items() if t.resolve() == resolved), None)
    return None if pair is None else pair_surface(pair, cpu, l3_kib)


HELDOUT_PROMPTS = MODELS_DIR / "prompts.jsonl"  # one {"id": str, "text": str} per line
TRACES_DIR = ROOT.parent / "shared" / "traces"  # read by path, never copied in
