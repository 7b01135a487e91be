"""IncrementalDetokenizer: token ids in, text deltas out, never splitting a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
gives U+FFFD. The delta is held back until the character is complete (the TGI / vLLM
prefix-offset method: decode a short window of already-emitted tokens plus the new ones and
emit only the text past the window's old text). ``flush`` releases whatever is held at the end.

Used by the engine (stop strings) and by the gateway (streamed text).
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (may be "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Release held-back text (a genuinely invalid byte sequence decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
