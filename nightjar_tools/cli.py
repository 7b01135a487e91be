"""The ``nightjar`` command: a thin table of subcommands, each owned by its service.

Every entry is ``"module:function"``; the function takes the remaining argv and returns an
exit code. Imports are lazy so ``nightjar --help`` stays instant (torch is not loaded).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("nightjar_tools.demo:main", "start the whole stack, stream one completion, stop"),
    "serve": ("nightjar_tools.serve:main", "run the whole stack on this machine"),
    "gateway": ("gateway.__main__:main", "run the gRPC gateway alone"),
    "scheduler": ("scheduler_svc.__main__:main", "run the scheduler alone"),
    "planner": ("planner_svc.__main__:main", "run the planner alone"),
    "worker": ("worker.__main__:main", "run one worker alone"),
    "generate": ("nightjar_client.cli:main", "send a prompt to a running stack"),
    "queue": ("nightjar_tools.queue_tool:main", "inspect the Redis queues, workers, policy"),
    "health": ("nightjar_client.health:main", "check a service's gRPC health (exit 0 = SERVING)"),
    "bench": ("nightjar_tools.bench:main", "replay load against a running stack"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: nightjar [--version] COMMAND [ARGS]\n\ncommands:\n{rows}\n\n'nightjar COMMAND --help' shows each command's options."


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("nightjar")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"nightjar {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nightjar: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func = COMMANDS[name][0].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
