"""FastTokenizer: the backend called directly gives exactly the wrapper's ids and text."""

from __future__ import annotations

import random

from nightjar.text import FastTokenizer, IncrementalDetokenizer
from tests.conftest import pair, tokenizer


def test_direct_backend_matches_the_wrapper():
    tok = tokenizer(pair()[0])
    fast = FastTokenizer(tok)
    assert fast.direct, "the shipped tokenizer should take the direct path"
    rng = random.Random(0)
    alphabet = "abcxyz_ ()=:.\n\t0123456789éü世界🙂—"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text)
        assert fast.encode(text) == ids
        cut = rng.randint(0, len(ids))  # a prefix may end inside a character
        for skip in (True, False):
            assert fast.decode(ids[:cut], skip_special_tokens=skip) == tok.decode(ids[:cut], skip_special_tokens=skip)


def test_detokenizer_through_the_fast_path_streams_the_same_text():
    tok = tokenizer(pair()[0])
    text = "naïve café — 日本語 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    slow, fast = IncrementalDetokenizer(tok), IncrementalDetokenizer(FastTokenizer(tok))
    assert [fast.push([t]) for t in ids] + [fast.flush()] == [slow.push([t]) for t in ids] + [slow.flush()]


class _WrapperOnly:
    """A tokenizer without a Rust backend (a slow tokenizer): FastTokenizer must keep its methods."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def encode(self, text):
        return self._tok.encode(text) + [7]  # marks that this method, not a backend, answered

    def decode(self, ids, skip_special_tokens=True):
        return "wrapped:" + self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_without_a_backend_the_wrapper_answers():
    fast = FastTokenizer(_WrapperOnly(tokenizer(pair()[0])))
    assert not fast.direct
    assert fast.encode("x")[-1] == 7
    assert fast.decode([5]).startswith("wrapped:")
