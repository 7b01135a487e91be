"""``nightjar bench``: end-to-end load benchmark of the running stack (see nightjar_tools/bench/cli.py)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from nightjar_tools.bench.cli import main as _main

    return _main(argv)


__all__ = ["main"]
