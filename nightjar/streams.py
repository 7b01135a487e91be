"""Redis stream conventions every service shares: consumer groups and the dead-letter stream."""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

from nightjar.keys import Keys
from nightjar.messages import DeadLetter

DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024  # the copy of the bad entry kept in its dead letter
DEAD_LETTER_MAXLEN = 10_000  # entries the dead-letter stream keeps (approximate trim)


async def ensure_group(redis: Any, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` from id 0 (MKSTREAM); a group that exists already is fine."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def dead_letter(pipe: Any, keys: Keys, entry_id: str, reason: str, raw: bytes, unix_ms: int, deliveries: int = 1,
                maxlen: int = DEAD_LETTER_MAXLEN) -> DeadLetter:
    """Queue on ``pipe`` the XADD that keeps a bad entry (truncated) where `nightjar queue dlq` shows it."""
    letter = DeadLetter(entry_id=entry_id, reason=reason, deliveries=deliveries,
                        payload=bytes(raw[:DEAD_LETTER_PAYLOAD_BYTES]), unix_ms=unix_ms)
    pipe.xadd(keys.dead_letters, {b"dl": letter.encode()}, maxlen=maxlen, approximate=True)
    return letter
