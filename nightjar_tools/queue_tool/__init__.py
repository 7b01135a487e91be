"""``nightjar queue``: the Redis queue inspection tool (see cli.py for the commands)."""

from .cli import main

__all__ = ["main"]
