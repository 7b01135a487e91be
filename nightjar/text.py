"""Text: the tokenizer wrapper and the incremental detokenizer, shared by gateway and engine.

FastTokenizer calls the Rust ``tokenizers`` backend directly, skipping transformers' Python
wrappers (most of an encode's or decode's time: BENCHMARKS.md, "Gateway"), but only after
checking on probes, once, that the results are identical; otherwise it keeps the wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"
PROBE = "def f(x):\n    return x  # héllo, 世界 \u2014 ok\n\tüñï 🙂"


class FastTokenizer:
    """``encode(text) -> ids`` and ``decode(ids, skip_special_tokens=...) -> str``, as the wrapped
    tokenizer's (special tokens added on encode, as its ``encode`` does)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and self._agrees(tokenizer, backend) else None

    @staticmethod
    def _agrees(tokenizer: Any, backend: Any) -> bool:
        ids = tokenizer.encode(PROBE)
        if backend.encode(PROBE, add_special_tokens=True).ids != ids:
            return False
        specials = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
        probes = [ids[:n] for n in range(len(ids) + 1)] + [specials + ids[:5] + specials]  # prefixes split characters
        return all(backend.decode(p, skip_special_tokens=skip) == tokenizer.decode(p, skip_special_tokens=skip)
                   for p in probes for skip in (True, False))

    @property
    def backend(self) -> Any | None:
        """The tokenizers.Tokenizer, when it is called directly (else None)."""
        return self._backend

    @property
    def direct(self) -> bool:
        """True when the backend is called directly."""
        return self._backend is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is None:
            return self.tokenizer.encode(text) if add_special_tokens else self.tokenizer.encode(text, add_special_tokens=False)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)



class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a UTF-8 character.

    With a FastTokenizer that calls its backend directly, tokenizers' own DecodeStream does the
    work (in Rust, one call per chunk, as vLLM v1 does). Otherwise the prefix-window method:
    decode a short window of emitted tokens plus the new ones, emit only the text past the
    window's old text, and hold a delta that ends in U+FFFD. ``flush`` releases what is held.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._backend = tokenizer.backend if isinstance(tokenizer, FastTokenizer) else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (may be "")."""
        self._ids.extend(token_ids)
        if self._stream is not None:
            delta = self._stream.step(self._backend, list(token_ids)) or ""
            if delta:
                self._read = len(self._ids)
        else:
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new_text = self._decode(self._ids[self._prefix :])
            if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
                return ""
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release held-back text (a genuinely invalid byte sequence decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        if self._stream is not None:  # rare: the stream still holds an unfinished character
            full = self._decode(self._ids)
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
        else:
            delta = self._decode(self._ids[self._prefix :])[len(self._decode(self._ids[self._prefix : self._read])) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
