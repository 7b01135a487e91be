"""Pure parts of the SDK: retry policy (injected clock and random source), error mapping, request building."""

from __future__ import annotations

import random

import grpc
import pytest

from nightjar.v1 import inference_pb2 as pb
from nightjar_client import errors
from nightjar_client.config import check_target, env_target, env_token
from nightjar_client.records import Accumulator, build_request, delta_from
from nightjar_client.retry import Attempts, RetryPolicy


class FixedRng(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


UNAVAILABLE = errors.Unavailable("down")


def test_backoff_grows_exponentially_and_caps():
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.5)
    no_jitter = FixedRng(0.0)  # factor 1 - 0.5 * 0 = 1
    delays = [policy.delay_s(n, UNAVAILABLE, no_jitter) for n in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    full = FixedRng(1.0)  # factor 1 - 0.5 = 0.5
    assert policy.delay_s(2, UNAVAILABLE, full) == pytest.approx(0.2)


def test_jitter_spreads_delays_within_bounds():
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.0, jitter=1.0, max_attempts=3)
    rng = random.Random(7)
    delays = [policy.delay_s(0, UNAVAILABLE, rng) for _ in range(200)]
    assert all(0.0 <= d <= 1.0 for d in delays)
    assert max(delays) - min(delays) > 0.5  # really spread, not one value


def test_never_retries_invalid_argument_or_unauthenticated():
    policy = RetryPolicy(max_attempts=10)
    for exc in (errors.InvalidArgument("bad"), errors.Unauthenticated("no"), errors.DeadlineExceeded("late"),
                errors.Internal("boom")):
        assert policy.delay_s(0, exc, random.Random(0)) is None


def test_retry_after_hint_is_a_floor_and_is_capped():
    policy = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05, jitter=0.0, max_retry_after_s=2.0)
    hinted = errors.ResourceExhausted("full", retry_after_s=0.75)
    assert policy.delay_s(0, hinted, FixedRng(0.0)) == pytest.approx(0.75)
    assert policy.delay_s(0, hinted, FixedRng(1.0)) == pytest.approx(0.825)  # +10% jitter at most
    huge = errors.ResourceExhausted("full", retry_after_s=600.0)
    assert policy.delay_s(0, huge, FixedRng(0.0)) == pytest.approx(2.0)
    # Without the hint it is gRPC refusing the call's size (e.g. headers over the limit), not a
    # full queue: the same call would be refused again, so it is not retried.
    unhinted = errors.ResourceExhausted("received metadata size exceeds hard limit")
    assert not unhinted.retryable
    assert policy.delay_s(0, unhinted, FixedRng(0.0)) is None


def test_attempts_stop_at_max_attempts():
    attempts = Attempts(RetryPolicy(max_attempts=3, jitter=0.0), None, clock=Clock(), rng=FixedRng(0))
    assert attempts.next_delay(UNAVAILABLE) is not None
    assert attempts.next_delay(UNAVAILABLE) is not None
    assert attempts.next_delay(UNAVAILABLE) is None  # third failure = third attempt used up
    assert attempts.retries == 2


def test_attempts_respect_the_deadline():
    clock = Clock()
    attempts = Attempts(RetryPolicy(max_attempts=10, initial_backoff_s=0.4, max_backoff_s=10, jitter=0.0),
                        1.0, clock=clock, rng=FixedRng(0))
    assert attempts.remaining_s() == pytest.approx(1.0)
    assert attempts.next_delay(UNAVAILABLE) == pytest.approx(0.4)
    clock.t += 0.45
    assert attempts.remaining_s() == pytest.approx(0.55)
    assert attempts.next_delay(UNAVAILABLE) is None  # 0.8 s more would pass the deadline
    clock.t += 0.6
    with pytest.raises(errors.DeadlineExceeded):
        attempts.remaining_s()
    with pytest.raises(ValueError, match="deadline_s"):
        Attempts(RetryPolicy(), 0.0)


def test_policy_validation_says_what_to_fix():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=2)


@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.Internal),
    (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
    (grpc.StatusCode.UNKNOWN, errors.Unknown),
])
def test_error_mapping(code, cls):
    err = errors.from_status(code, "details here", ())
    assert type(err) is cls
    assert isinstance(err, errors.NightjarError)
    assert err.code == code
    assert "details here" in str(err)
    assert err.retryable == (cls is errors.Unavailable)  # RESOURCE_EXHAUSTED only with the queue's hint
    if cls is errors.ResourceExhausted:
        assert errors.from_status(code, "queue full", (("retry-after-ms", "100"),)).retryable


def test_retry_after_metadata_parsing():
    assert errors.retry_after_s((("retry-after-ms", "250"),)) == pytest.approx(0.25)
    assert errors.retry_after_s((("Retry-After-Ms", b"1000"),)) == pytest.approx(1.0)
    assert errors.retry_after_s((("retry-after-ms", "soon"),)) is None
    assert errors.retry_after_s((("retry-after-ms", "-5"),)) is None
    assert errors.retry_after_s(None) is None
    err = errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", (("retry-after-ms", "40"),))
    assert err.retry_after_s == pytest.approx(0.04)


def test_build_request_fields_and_client_side_errors():
    req = build_request("hi", max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop="END")
    assert (req.prompt, req.max_tokens, req.top_k, req.seed, list(req.stop)) == ("hi", 5, 40, 3, ["END"])
    assert req.temperature == pytest.approx(0.7)
    assert not build_request("hi").HasField("seed")  # unset = server picks a random seed
    assert build_request("hi", seed=0).HasField("seed")
    with pytest.raises(errors.InvalidArgument, match="max_tokens"):
        build_request("hi", max_tokens=-1)
    with pytest.raises(errors.InvalidArgument, match="top_k"):
        build_request("hi", top_k=1.5)
    with pytest.raises(errors.InvalidArgument, match="prompt"):
        build_request(b"bytes")


def test_accumulator_assembles_a_completion():
    acc = Accumulator()
    acc.add(delta_from(pb.GenerateResponse(request_id="r1", text="Hel", token_ids=[1, 2])))
    assert acc.started
    acc.add(delta_from(pb.GenerateResponse(request_id="r1", text="lo", token_ids=[3])))
    acc.add(delta_from(pb.GenerateResponse(request_id="r1", finish_reason=pb.FINISH_REASON_LENGTH,
                                           usage=pb.Usage(prompt_tokens=4, completion_tokens=3),
                                           ttft_ms=2.0, e2e_ms=9.0)))
    c = acc.completion()
    assert (c.text, c.token_ids, c.finish_reason, c.request_id) == ("Hello", (1, 2, 3), "length", "r1")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.timings.ttft_ms, c.timings.e2e_ms) == (4, 3, 2.0, 9.0)


def test_env_and_target_checks():
    assert env_target({}) == "127.0.0.1:50051"
    assert env_target({"NIGHTJAR_TARGET": "gw:7000"}) == "gw:7000"
    assert env_token({"NIGHTJAR_TOKEN": "s3cret"}) == "s3cret"
    assert env_token({}) is None
    assert check_target("localhost:50051") == "localhost:50051"
    for bad in ("localhost", "http://x:1", "x:0", "x:port", ""):
        with pytest.raises(ValueError, match="host:port"):
            check_target(bad)
