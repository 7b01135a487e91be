"""From indexed token chunks to the text a client sees: drop re-sent tokens, cut at stop strings.

Pure logic (no I/O) so it is unit-tested on its own. The detokenizer itself (never splits a
UTF-8 character) is nightjar.text.IncrementalDetokenizer, shared with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence


class IndexDedup:
    """Keeps only tokens not yet sent, by completion index.

    A request re-run on another worker re-emits indices from 0; chunks of a worker that was
    wrongly declared dead may interleave with the new one's. Both produce the same tokens at
    the same indices (greedy, or seeded sampling), so the first copy of each index wins.
    """

    def __init__(self) -> None:
        self.next_index = 0

    def fresh(self, index: int, token_ids: Sequence[int]) -> list[int]:
        """The tokens of a chunk starting at ``index`` that have not been sent yet."""
        if index > self.next_index:
            # A gap means entries were lost (e.g. the output stream expired and was recreated).
            raise ValueError(f"output chunk at index {index} skips ahead of {self.next_index}")
        skip = self.next_index - index
        new = list(token_ids[skip:])
        self.next_index += len(new)
        return new


class StopCutter:
    """Holds back text that could still become a stop string; cuts before the first one.

    Any text that ends with a proper prefix of a stop string is withheld until the next
    piece decides it, so a stop string split across chunks is still found and never sent.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the text that is safe to send now (empty once stopped)."""
        if self.stopped:
            return ""
        buf = self._pending + text
        if not self.stops:
            return buf
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of the completion: the withheld text was not a stop string after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_suffix(self, buf: str) -> int:
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest
