"""What the worker writes to Redis in one round trip, and what it reads back when it takes over
a request: the output scripts, the recorded pipeline (``Ops``) and the delivered prefix."""

from __future__ import annotations

from nightjar.keys import Keys
from nightjar.messages import MessageError, OutputChunk

# Delete an assignment only if it is still ours: after a false death (a long pause) the
# scheduler may have given the job to another worker, whose record must survive us.
RELEASE_ASSIGNMENT = """
if redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Every output chunk of a round trip in one command: one command for redis-py to pack and
# parse instead of one or two per chunk (those were most of the worker's event-loop CPU), and
# a script runs atomically, so the gateway's blocked XREAD wakes once with the whole step.
# A chunk is written only while the request's assignment does not name another worker: once
# the scheduler has moved it (we were taken for dead or stalled), the new owner continues
# from what the stream holds at that moment, and a chunk of ours after it would splice two
# samples into one completion. Returns the streams refused, so we abort our copy.
# KEYS: output streams, then their assignment hashes. ARGV: the TTL in ms, our worker id, then
# per stream its chunk, then per stream "1" if its TTL must be (re)set (first and final
# chunk: a stream nobody reads must expire).
_WRITE_OUTPUTS = """
local n = #KEYS / 2
local refused = {}
for i = 1, n do
  local owner = redis.call('HGET', KEYS[n + i], 'worker')
  if owner and owner ~= ARGV[2] then
    refused[#refused + 1] = KEYS[i]
  else
    redis.call('XADD', KEYS[i], '*', 'c', ARGV[2 + i])
    if ARGV[2 + n + i] == '1' then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
  end
end
return refused
"""


class Ops:
    """Records pipeline calls (xadd, pexpire, ...) so a failed round trip can be replayed.

    Output chunks go first, as one script call; inbox acknowledgements last, as one XACK and
    one XDEL: a job is never acknowledged before its final chunk (or its dead letter)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.outputs: list[tuple[str, bytes, bool, str]] = []  # (stream, chunk, set the TTL, request id)
        self.acks: list[bytes] = []  # inbox entries whose job is done
        self.released: list[str] = []  # request ids leaving this worker's assignment set

    def __getattr__(self, name: str):
        return lambda *args, **kw: self.calls.append((name, args, kw))

    def __len__(self) -> int:
        return len(self.calls) + len(self.outputs) + len(self.acks) + len(self.released)

    def replay(self, pipe, keys: Keys, worker_id: str, output_ttl_ms: int) -> None:
        if self.outputs:
            streams = [o[0] for o in self.outputs] + [keys.assignment(o[3]) for o in self.outputs]
            args = [output_ttl_ms, worker_id, *(o[1] for o in self.outputs), *(b"1" if o[2] else b"0" for o in self.outputs)]
            pipe.eval(_WRITE_OUTPUTS, len(streams), *streams, *args)
        for name, args, kw in self.calls:  # stats, dead letters, assignment releases
            getattr(pipe, name)(*args, **kw)
        if self.acks:
            inbox = keys.inbox(worker_id)
            pipe.xack(inbox, keys.worker_group, *self.acks)
            pipe.xdel(inbox, *self.acks)
        if self.released:
            pipe.srem(keys.worker_assignments(worker_id), *self.released)


def delivered_prefix(entries) -> tuple[list[int], bool]:
    """The completion a request's client has been sent so far, read from its output stream
    (first chunk at an index wins, as at the gateway), and whether a final chunk is there."""
    tokens: list[int] = []
    final = False
    for _entry_id, fields in entries:
        try:
            chunk = OutputChunk.decode(fields[b"c"])
        except (KeyError, MessageError):
            continue  # the gateway skips these too
        if chunk.index <= len(tokens) < chunk.index + len(chunk.token_ids):
            tokens += chunk.token_ids[len(tokens) - chunk.index:]
        final = final or chunk.finish_reason is not None
    return tokens, final
