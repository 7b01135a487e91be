import math

import msgpack
import pytest

from nightjar.messages import MAX_MESSAGE_BYTES, Job, MessageError, OutputChunk, Policy, SamplingParams, StepStats


def test_round_trip_keeps_every_field():
    job = Job("r1", (1, 2, 3), SamplingParams(max_tokens=5, stop=("\n",)).to_dict(), 10, 20, 1)
    back = Job.decode(job.encode())
    assert back.request_id == "r1" and back.prompt_token_ids == (1, 2, 3) and back.attempt == 1
    assert back.sampling == SamplingParams(max_tokens=5, stop=("\n",))


def test_wrong_types_and_missing_fields_are_rejected():
    with pytest.raises(MessageError, match="prompt_token_ids"):
        Job.from_dict({"request_id": "r", "prompt_token_ids": ["x"], "params": {}})
    with pytest.raises(MessageError, match="missing required field `request_id`"):
        Job.from_dict({"prompt_token_ids": [], "params": {}})
    with pytest.raises(MessageError, match="Expected `int`, got `bool`"):
        OutputChunk.from_dict({"request_id": "r", "index": True})


def test_garbage_and_oversized_payloads_raise_message_error():
    with pytest.raises(MessageError):
        Job.decode(b"\xc1\xff garbage")
    with pytest.raises(MessageError, match="Expected `object`, got `array`"):
        Job.decode(msgpack.packb([1, 2]))
    with pytest.raises(MessageError, match="exceeds"):
        Job.decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_unknown_fields_are_ignored_for_forward_compatibility():
    raw = msgpack.packb({"request_id": "r", "index": 3, "new_field": 1})
    assert OutputChunk.decode(raw).index == 3


def test_policy_lookup_and_validation():
    p = Policy(1, 0, 5.0, (1, 4, 16), (4, 2, 0))
    assert [p.gamma_for(b) for b in (1, 2, 4, 5, 16, 64)] == [4, 2, 2, 0, 0, 0]
    assert Policy.decode(p.encode()) == p
    with pytest.raises(MessageError):
        Policy.from_dict({"version": 1, "unix_ms": 0, "ttl_s": 1.0, "bucket_upper_bounds": [4, 1], "gamma_by_bucket": [1, 1]})


def test_float_fields_accept_ints():
    s = StepStats.from_dict({"worker_id": "w", "step": 1, "unix_ms": 0, "batch_size": 1, "gamma": 0,
                             "draft_ms": 0, "verify_ms": 1, "step_ms": 1.5})
    assert isinstance(s.draft_ms, float) and not math.isnan(s.step_ms)
