"""Pure gateway logic: validation, dedup by index, stop-string cutting, admission, status codes."""

from __future__ import annotations

import math

import grpc
import pytest
import redis.exceptions
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.admission import AdmissionTable
from gateway.interceptors import status_for
from gateway.text_stream import IndexDedup, StopCutter
from gateway.validation import Limits, check_length, validate
from nightjar.v1 import inference_pb2 as pb

LIMITS = Limits(default_max_tokens=64, max_tokens_limit=512, max_context_tokens=1024)


def req(**kw) -> pb.GenerateRequest:
    kw.setdefault("prompt", "hello")
    return pb.GenerateRequest(**kw)


def test_valid_request_fills_defaults():
    v = validate(req(seed=7, stop=["\n\n"]), LIMITS)
    assert v.params.max_tokens == 64 and v.params.top_p == 1.0 and v.params.temperature == 0.0
    assert v.params.seed == 7 and v.params.stop == ("\n\n",)
    assert validate(req(), LIMITS).params.seed is None


@pytest.mark.parametrize("kw, field", [
    ({"prompt": "  \n"}, "prompt"),
    ({"max_tokens": 513}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": 1001}, "top_k"),
    ({"stop": ["x"] * 9}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
    ({"stop": ["y" * 65]}, "stop[0]"),
    ({"request_id": "has space"}, "request_id"),
    ({"request_id": "x" * 65}, "request_id"),
])
def test_invalid_fields_are_named(kw, field):
    with pytest.raises(errors.InvalidArgument) as exc:
        validate(req(**kw), LIMITS)
    assert exc.value.field == field
    assert str(exc.value).startswith(field + ":")


def test_prompt_plus_completion_must_fit_the_context():
    check_length(1000, 24, LIMITS)
    with pytest.raises(errors.InvalidArgument, match="at most 1000 prompt tokens"):
        check_length(1001, 24, LIMITS)


def test_dedup_drops_resent_indices():
    d = IndexDedup()
    assert d.fresh(0, [1, 2, 3]) == [1, 2, 3]
    assert d.fresh(0, [1, 2]) == []  # a re-run worker starts again at 0
    assert d.fresh(2, [3, 4, 5]) == [4, 5]  # overlaps what was sent
    assert d.fresh(5, [6]) == [6]
    with pytest.raises(ValueError, match="skips ahead"):
        d.fresh(9, [7])


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=1, max_size=40), data=st.data())
def test_dedup_reassembles_any_interleaving_of_two_runs(tokens, data):
    """Two runs of the same request, chunked differently, interleaved: each token exactly once."""
    def chunks():
        out, i = [], 0
        while i < len(tokens):
            n = data.draw(st.integers(1, 5))
            out.append((i, tokens[i:i + n]))
            i += n
        return out
    a, b = chunks(), chunks()
    merged = []
    while a or b:  # an interleaving that keeps each run in order
        src = a if (a and (not b or data.draw(st.booleans()))) else b
        merged.append(src.pop(0))
    d, got = IndexDedup(), []
    for index, toks in merged:
        if index <= d.next_index:
            got += d.fresh(index, toks)
    assert got == tokens


def run_cutter(stops, pieces):
    c = StopCutter(stops)
    out = "".join(c.push(p) for p in pieces)
    return out + c.flush(), c.stopped


def test_stop_string_split_across_pieces_is_cut_and_never_sent():
    assert run_cutter(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)
    assert run_cutter(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_held_text_is_released_when_it_is_not_a_stop():
    c = StopCutter(["END"])
    assert c.push("abEN") == "ab"  # "EN" might start END
    assert c.push("x") == "ENx"
    assert c.push("E") == ""
    assert c.flush() == "E"


def test_earliest_stop_wins_and_no_stops_pass_through():
    assert run_cutter(["bb", "a"], ["xxbba"]) == ("xx", True)
    assert run_cutter([], ["any", "thing"]) == ("anything", False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abE\nND", max_size=30), stops=st.lists(st.text(alphabet="abE\nND", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
@example(text="D\nD", stops=["\n", "D\nD"], cuts=[2])  # found by hypothesis in CI
def test_cutter_matches_a_search_of_the_text_so_far(text, stops, cuts):
    """After each piece, the first stop string in everything generated so far ends the text.

    Not a search of the whole text: once a stop is complete the request ends, so text that a
    later piece would have added (which could complete a longer stop that starts earlier, e.g.
    stops "\n" and "D\nD" on "D\n" + "D") is never generated."""
    pieces, prev = [], 0
    for c in sorted(set(cuts)):
        pieces.append(text[prev:c])
        prev = max(prev, c)
    pieces.append(text[prev:])
    expected, stopped, so_far = text, False, ""
    for piece in pieces:
        so_far += piece
        positions = [i for i in (so_far.find(s) for s in stops) if i >= 0]
        if positions:
            expected, stopped = so_far[: min(positions)], True
            break
    assert run_cutter(stops, pieces) == (expected, stopped)


async def test_admission_caps_queued_and_releases():
    t = AdmissionTable(max_streams=3, max_queued=2, retry_after_ms=100)
    a = await t.admit("a")
    b = await t.admit("b")
    with pytest.raises(errors.QueueFull) as exc:
        await t.admit("c")
    assert exc.value.retry_after_ms >= 100
    t.first_token(a)  # a is running now: one queue slot frees
    c = await t.admit("c")
    with pytest.raises(errors.QueueFull):  # three streams: the stream semaphore is full
        await t.admit("d")
    for e in (a, b, c):
        t.release(e)
    assert t.in_flight == 0 and t.queued == 0 and t.idle.is_set()
    t.backlog = 5  # undispatched jobs in Redis count against the cap too
    with pytest.raises(errors.QueueFull):
        await t.admit("e")


async def test_admission_refuses_while_draining_or_redis_down():
    t = AdmissionTable(4, 4, 100)
    t.redis_ok = False
    with pytest.raises(errors.Unavailable, match="unreachable"):
        await t.admit("a")
    t.redis_ok, t.draining = True, True
    with pytest.raises(errors.Unavailable, match="draining"):
        await t.admit("a")


async def test_admission_asks_redis_again_before_refusing_for_a_stale_poll():
    answers, asked = [False, True], []

    async def recheck() -> bool:
        asked.append(1)
        return answers[len(asked) - 1]

    t = AdmissionTable(4, 4, 100, recheck=recheck)
    t.redis_ok = False
    with pytest.raises(errors.Unavailable, match="unreachable"):  # still down: refused
        await t.admit("a")
    entry = await t.admit("b")  # back since the last poll: admitted, and the flag follows
    assert t.redis_ok and t.in_flight == 1 and entry.request_id == "b"
    await t.admit("c")
    assert len(asked) == 2, "a healthy flag is trusted: no Redis round trip per request"
    t.redis_ok, t.draining = False, True
    with pytest.raises(errors.Unavailable, match="draining"):
        await t.admit("d")
    assert len(asked) == 2, "a draining gateway refuses without asking Redis"


def test_status_codes():
    assert status_for(errors.InvalidArgument("top_k", "bad"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, _, trailer = status_for(errors.QueueFull("full", 250))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and trailer == (("retry-after-ms", "250"),)
    assert status_for(redis.exceptions.ConnectionError("down"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(errors.Unauthenticated("no"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert status_for(RuntimeError("boom"))[:2] == (grpc.StatusCode.INTERNAL, "internal error (see the gateway log)")


def test_chunks_waiting_together_become_one_response_with_every_token_once():
    from gateway.completion import Completion
    from nightjar.messages import OutputChunk
    from tests.conftest import pair, tokenizer

    tok = tokenizer(pair()[0])
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)[:6]
    c = Completion(tok, [1, 2], (), 0.0)
    first, failure = c.take([OutputChunk("r", 0, tuple(ids[:2]))])
    assert failure is None and list(first.token_ids) == ids[:2]
    # A re-run's repeat of index 0-1, then two fresh chunks: one response, each token once.
    merged, failure = c.take([OutputChunk("r", 0, tuple(ids[:3])), OutputChunk("r", 3, tuple(ids[3:5]))])
    assert failure is None and list(merged.token_ids) == ids[2:5]
    assert first.text + merged.text == tok.decode(ids[:5])
    # A failure after tokens: the tokens still go out, then the error.
    last, failure = c.take([OutputChunk("r", 5, (ids[5],)), OutputChunk("r", 6, finish_reason="error", error="boom")])
    assert list(last.token_ids) == [ids[5]] and isinstance(failure, errors.RequestFailed) and c.sent == 6
