"""The import rules of docs/architecture.md, read from the AST of every module (lazy imports too).

A room may import itself and the rooms listed for it; a back edge fails, naming file and import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nightjar", "nightjar_tools", "nightjar_client", "gateway", "scheduler_svc", "planner_svc", "worker")

# room -> the rooms it may import (besides itself). The longest matching room wins.
RULES: dict[str, tuple[str, ...]] = {
    "nightjar": (),  # contracts: messages, keys, text, Redis helpers
    "nightjar_client": (),  # its own distribution: grpcio and protobuf only
    "gateway": ("nightjar",),
    "scheduler_svc": ("nightjar",),
    "planner_svc": ("nightjar",),
    "worker.engine": ("nightjar",),
    "worker.host": ("worker.engine", "nightjar"),
    "worker.service": ("worker.host", "worker.engine", "nightjar"),
    "worker": ("worker.service", "nightjar"),  # worker/__main__.py
    "nightjar_tools": (),  # tools may import anything (below)
}
RULES["nightjar_tools"] = tuple(RULES)
# Entry-point shims, by file: `python -m nightjar` runs the tools' command table.
ALLOWED = {("nightjar/__main__.py", "nightjar_tools.cli")}


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    rooms = [r for r in RULES if module == r or module.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from worker.engine import engine` names the module worker.engine.engine
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] in PACKAGES]


def back_edges(root: Path = ROOT) -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            room = _room(_module(path, root))
            allowed = (room, *RULES[room])
            for line, name in _imports(path):
                if _room(name) in allowed or (rel, name.rsplit(".", 1)[0]) in ALLOWED or (rel, name) in ALLOWED:
                    continue
                bad.append(f"{rel}:{line} imports {name} ({room} may import {', '.join(allowed)})")
    return bad


def test_no_back_edges():
    bad = back_edges()
    assert not bad, "import rules broken:\n" + "\n".join(bad)


def test_the_engine_is_the_top_of_its_room():
    """The engine owns its parts (memory manager, scheduler, runners) and hands them what they
    need: none of them imports the engine back, not even for a type."""
    bad = [f"{p.relative_to(ROOT).as_posix()}:{line} imports {name}"
           for p in sorted((ROOT / "worker" / "engine").glob("*.py")) if p.name != "engine.py"
           for line, name in _imports(p) if name == "worker.engine.engine" or name.startswith("worker.engine.engine.")]
    assert not bad, "a part of the engine imports the engine:\n" + "\n".join(bad)


def test_rule_catches_a_back_edge(tmp_path):
    """The checker itself: a lazy import of worker code in the gateway is reported with file and line."""
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "bad.py").write_text("import os\n\n\ndef f():\n    from worker.engine.sampler import sample\n")
    assert back_edges(tmp_path) == [
        "gateway/bad.py:5 imports worker.engine.sampler.sample (gateway may import gateway, nightjar)"]
