"""The bad-input catalogue: every malformed request gets its documented status code and a message
naming the field, through raw gRPC (bytes on the wire) and through the SDK; good requests sent at
the same time complete unaffected; afterwards nothing stays allocated (KV blocks, queues, keys).

The codes are the ones documented in docs/reliability.md and proto/nightjar/v1/inference.proto.
"""

from __future__ import annotations

import asyncio
import math
import socket

import grpc
import pytest

from nightjar.v1 import inference_pb2 as pb
from nightjar_client import NO_RETRY, AsyncClient, Client, RetryPolicy
from nightjar_client import errors as sdk
from tests.stack.conftest import (
    IDLE,
    TOKEN,
    assert_same_greedy,
    dead_services,
    hardened_stack,
    metadata,
    per_request_keys_without_ttl,
    wait_idle,
)

GENERATE = "/nightjar.v1.InferenceService/Generate"
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def stack():
    return hardened_stack()


@pytest.fixture(scope="module")
def raw_generate(stack):
    """Generate with the request given as raw bytes, so malformed wire data can be sent."""
    channel = grpc.insecure_channel(stack.address)
    yield channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    channel.close()


def req(prompt: str = "Tell me a story", max_tokens: int = 2, **kw) -> bytes:
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **kw).SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def varint(field: int, value: int) -> bytes:
    """One varint field on the wire; a negative value is sent as protobuf sends an int64 (10 bytes)."""
    return _varint(field << 3) + _varint(value & ((1 << 64) - 1))


def fixed32(field: int, value: float) -> bytes:
    import struct

    return bytes([(field << 3) | 5]) + struct.pack("<f", value)


BEARER = metadata()
# (id, request bytes, metadata, timeout_s, expected code, text the details must contain)
RAW_CASES = [
    ("prompt-empty", req(""), BEARER, None, INVALID, "prompt"),
    ("prompt-whitespace", req(" \t\n\r "), BEARER, None, INVALID, "prompt"),
    ("prompt-missing", pb.GenerateRequest(max_tokens=2).SerializeToString(), BEARER, None, INVALID, "prompt"),
    ("all-fields-missing", b"", BEARER, None, INVALID, "prompt"),
    ("prompt-over-1MiB", req("a" * (1 << 20) + "b"), BEARER, None, INVALID, "prompt"),
    ("prompt-over-context", req("word " * 5000), BEARER, None, INVALID, "prompt"),
    ("prompt-plus-max-tokens-over-context", req("word " * 700, max_tokens=1000), BEARER, None, INVALID, "prompt"),
    ("prompt-invalid-utf8", b"\x0a\x03\xff\xfe\xfd" + varint(2, 2), BEARER, None, INVALID, "request"),
    ("max-tokens-above-limit", req(max_tokens=1025), BEARER, None, INVALID, "max_tokens"),
    ("max-tokens-uint32-max", req(max_tokens=2**32 - 1), BEARER, None, INVALID, "max_tokens"),
    ("max-tokens-negative", req(max_tokens=0) + varint(2, -1), BEARER, None, INVALID, "max_tokens"),
    ("temperature-negative", req(temperature=-0.5), BEARER, None, INVALID, "temperature"),
    ("temperature-nan", req(temperature=math.nan), BEARER, None, INVALID, "temperature"),
    ("temperature-inf", req(temperature=math.inf), BEARER, None, INVALID, "temperature"),
    ("temperature-minus-inf", req(temperature=-math.inf), BEARER, None, INVALID, "temperature"),
    ("temperature-above-2", req(temperature=2.5), BEARER, None, INVALID, "temperature"),
    ("temperature-float-max", req() + fixed32(3, 3.4e38), BEARER, None, INVALID, "temperature"),
    ("top-p-negative", req(top_p=-0.1), BEARER, None, INVALID, "top_p"),
    ("top-p-above-1", req(top_p=1.5), BEARER, None, INVALID, "top_p"),
    ("top-p-nan", req(top_p=math.nan), BEARER, None, INVALID, "top_p"),
    ("top-p-inf", req(top_p=math.inf), BEARER, None, INVALID, "top_p"),
    ("top-k-above-limit", req(top_k=1001), BEARER, None, INVALID, "top_k"),
    ("top-k-negative", req() + varint(5, -1), BEARER, None, INVALID, "top_k"),
    ("stop-empty-string", req(stop=["ok", ""]), BEARER, None, INVALID, "stop[1]"),
    ("stop-too-many", req(stop=[f"s{i}" for i in range(9)]), BEARER, None, INVALID, "stop"),
    ("stop-thousands", req(stop=["a"] * 10_000), BEARER, None, INVALID, "stop"),
    ("stop-too-long", req(stop=["x" * 65]), BEARER, None, INVALID, "stop[0]"),
    ("stop-too-long-multibyte", req(stop=["€" * 22]), BEARER, None, INVALID, "stop[0]"),  # 66 bytes, 22 chars
    ("seed-above-int63", req(seed=2**63), BEARER, None, INVALID, "seed"),
    ("seed-negative-on-wire", req() + varint(6, -1), BEARER, None, INVALID, "seed"),
    ("request-id-too-long", req(request_id="r" * 65), BEARER, None, INVALID, "request_id"),
    ("request-id-space", req(request_id="my id"), BEARER, None, INVALID, "request_id"),
    ("request-id-non-ascii", req(request_id="idé"), BEARER, None, INVALID, "request_id"),
    ("request-id-control-char", req(request_id="id\x00"), BEARER, None, INVALID, "request_id"),
    ("garbage-body", b"\xff\xff\xff\xff\x00garbage", BEARER, None, INVALID, "request"),
    ("truncated-body", req()[:-3], BEARER, None, INVALID, "request"),
    ("length-prefix-past-end", b"\x0a\x7fabc", BEARER, None, INVALID, "request"),
    ("oversized-message", req("a" * (5 << 20)), BEARER, None, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("deadline-already-expired", req(), BEARER, 0.0005, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline"),
    # 900 tokens take seconds even on the packed CPU path (400 finished inside 1 s there)
    ("deadline-mid-generation", req(max_tokens=900, ignore_eos=True), BEARER, 0.5, grpc.StatusCode.DEADLINE_EXCEEDED, "eadline"),
    ("auth-missing", req(), (), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ("auth-wrong-token", req(), (("authorization", "Bearer wrong"),), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ("auth-token-prefix", req(), (("authorization", f"Bearer {TOKEN[:-1]}"),), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ("auth-basic-scheme", req(), (("authorization", f"Basic {TOKEN}"),), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ("auth-no-scheme", req(), (("authorization", TOKEN),), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    # Under the gateway's 16 KiB metadata limit a wrong token is a wrong token, always (gRPC's
    # default soft limit refused this one at random); over it, gRPC refuses the headers.
    ("auth-huge-token", req(), (("authorization", "Bearer " + "x" * 12000),), None, grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ("auth-token-over-limit", req(), (("authorization", "Bearer " + "x" * 20000),), None, grpc.StatusCode.RESOURCE_EXHAUSTED, "metadata"),
    # Documented as accepted: unknown field numbers and mismatched wire types are skipped
    # (forward compatibility), zero values mean the defaults, and the limits themselves pass.
    ("unknown-field-ignored", req() + varint(99, 5), BEARER, None, OK, ""),
    ("wrong-wire-type-ignored", b"\x12\x01a" + req(), BEARER, None, OK, ""),
    ("zero-values-mean-defaults", req(max_tokens=2, top_p=0.0, temperature=0.0, top_k=0), BEARER, None, OK, ""),
    ("limits-accepted", req(temperature=2.0, top_p=1.0, top_k=1000, seed=2**63 - 1,
                            stop=["s" * 64] + ["z"] * 7, request_id="r" * 64), BEARER, None, OK, ""),
]


def call_raw(raw_generate, body: bytes, md, timeout_s) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    responses: list[pb.GenerateResponse] = []
    try:
        for resp in raw_generate(body, metadata=md, timeout=timeout_s if timeout_s is not None else 60):
            responses.append(resp)
        return OK, "", responses
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", responses


@pytest.mark.parametrize("body,md,timeout_s,code,needle", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_raw_grpc_case(raw_generate, body, md, timeout_s, code, needle):
    got, details, responses = call_raw(raw_generate, body, md, timeout_s)
    assert got == code, f"expected {code.name}, got {got.name}: {details}"
    assert needle in details, f"details {details!r} do not name {needle!r}"
    if code == INVALID:
        assert details.startswith(needle.split("[")[0]), f"the field must come first: {details!r}"
        assert not responses, "a refused request must not stream anything"
    if code == OK:
        assert responses and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


# (id, Generate keyword arguments, expected SDK exception, text its message must contain)
SDK_CASES = [
    ("prompt-empty", dict(prompt=""), sdk.InvalidArgument, "prompt"),
    ("prompt-whitespace", dict(prompt="   \n"), sdk.InvalidArgument, "prompt"),
    ("prompt-not-a-string", dict(prompt=b"bytes"), sdk.InvalidArgument, "prompt"),
    ("prompt-over-context", dict(prompt="word " * 5000), sdk.InvalidArgument, "prompt"),
    ("max-tokens-negative", dict(max_tokens=-1), sdk.InvalidArgument, "max_tokens"),
    ("max-tokens-above-limit", dict(max_tokens=5000), sdk.InvalidArgument, "max_tokens"),
    ("max-tokens-over-uint32", dict(max_tokens=2**40), sdk.InvalidArgument, "max_tokens"),
    ("max-tokens-string", dict(max_tokens="5"), sdk.InvalidArgument, "max_tokens"),
    ("temperature-negative", dict(temperature=-1.0), sdk.InvalidArgument, "temperature"),
    ("temperature-nan", dict(temperature=math.nan), sdk.InvalidArgument, "temperature"),
    ("temperature-inf", dict(temperature=math.inf), sdk.InvalidArgument, "temperature"),
    ("temperature-string", dict(temperature="hot"), sdk.InvalidArgument, "temperature"),
    ("top-p-negative", dict(top_p=-0.5), sdk.InvalidArgument, "top_p"),
    ("top-p-above-1", dict(top_p=1.01), sdk.InvalidArgument, "top_p"),
    ("top-p-nan", dict(top_p=math.nan), sdk.InvalidArgument, "top_p"),
    ("top-k-negative", dict(top_k=-1), sdk.InvalidArgument, "top_k"),
    ("top-k-above-limit", dict(top_k=5000), sdk.InvalidArgument, "top_k"),
    ("stop-empty", dict(stop=[""]), sdk.InvalidArgument, "stop[0]"),
    ("stop-too-many", dict(stop=list("abcdefghij")), sdk.InvalidArgument, "stop"),
    ("stop-too-long", dict(stop=["y" * 100]), sdk.InvalidArgument, "stop[0]"),
    ("seed-negative", dict(seed=-1), sdk.InvalidArgument, "seed"),
    ("seed-above-int63", dict(seed=2**63 + 5), sdk.InvalidArgument, "seed"),
    ("seed-above-uint64", dict(seed=2**64), sdk.InvalidArgument, "seed"),
    ("seed-float", dict(seed=1.5), sdk.InvalidArgument, "seed"),
    ("request-id-too-long", dict(request_id="q" * 100), sdk.InvalidArgument, "request_id"),
    ("deadline-tiny", dict(deadline_s=1e-4, max_tokens=400, ignore_eos=True), sdk.DeadlineExceeded, "DEADLINE_EXCEEDED"),
    ("deadline-mid-generation", dict(deadline_s=0.5, max_tokens=900, ignore_eos=True), sdk.DeadlineExceeded, "eadline"),
]


@pytest.mark.parametrize("kwargs,error,needle", [c[1:] for c in SDK_CASES], ids=[c[0] for c in SDK_CASES])
def test_sdk_case(stack, kwargs, error, needle):
    kwargs = {"prompt": "Tell me a story", "max_tokens": 2, **kwargs}
    prompt = kwargs.pop("prompt")
    with Client(stack.address, token=TOKEN, retry=NO_RETRY) as client:
        with pytest.raises(error) as info:
            client.generate(prompt, **kwargs)
    assert needle in str(info.value), f"{info.value!s} does not name {needle!r}"
    if error is sdk.InvalidArgument:
        assert not info.value.retryable


@pytest.mark.parametrize("token,error", [(None, sdk.Unauthenticated), ("nope", sdk.Unauthenticated),
                                          (TOKEN + "x", sdk.Unauthenticated)], ids=["missing", "wrong", "longer"])
def test_sdk_auth(stack, token, error):
    with Client(stack.address, token=token) as client:
        with pytest.raises(error, match="bearer token"):
            client.generate("hello", max_tokens=2)
        with pytest.raises(error):
            client.model_info()


def test_sdk_oversized_message_is_resource_exhausted_without_a_retry_after_hint(stack):
    with Client(stack.address, token=TOKEN, retry=NO_RETRY) as client:
        with pytest.raises(sdk.ResourceExhausted, match="larger than max") as info:
            client.generate("a" * (5 << 20), max_tokens=2)
    assert info.value.retry_after_s is None  # not the queue-full kind: waiting would not help


def test_unknown_method_is_unimplemented(stack):
    with grpc.insecure_channel(stack.address) as channel:
        call = channel.unary_unary("/nightjar.v1.InferenceService/Nope", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(b"", metadata=BEARER, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("payload", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64,
                                     b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x01\xff" * 50],
                         ids=["http1", "binary-noise", "http2-preface-then-junk"])
def test_garbage_bytes_on_the_port(stack, raw_generate, payload):
    with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as sock:
        sock.sendall(payload)
        sock.settimeout(5)
        try:
            while sock.recv(65536):  # the server answers with a GOAWAY / settings and closes
                pass
        except (TimeoutError, ConnectionResetError):
            pass
    code, _, responses = call_raw(raw_generate, req(), BEARER, None)
    assert code == OK and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert not dead_services(stack)


async def test_bad_requests_beside_good_ones_leave_nothing_allocated(stack):
    """The whole raw catalogue, fired concurrently with good greedy streams: the good streams
    produce exactly what they produce alone, and afterwards every counter is back at rest."""
    baseline = IDLE
    prompts = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "king", "ship", "tree", "bird")]
    async with AsyncClient(stack.address, token=TOKEN, retry=RetryPolicy(max_attempts=3)) as client:
        alone = [await client.generate(p, max_tokens=12, ignore_eos=True) for p in prompts[:2]]
        channel = grpc.aio.insecure_channel(stack.address)
        raw = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                   response_deserializer=pb.GenerateResponse.FromString)

        async def bad(case) -> grpc.StatusCode:
            _, body, md, timeout_s, code, _ = case
            try:
                async for _ in raw(body, metadata=md, timeout=timeout_s if timeout_s is not None else 60):
                    pass
                return OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        good = [client.generate(p, max_tokens=12, ignore_eos=True) for p in prompts]
        results = await asyncio.gather(*good, *(bad(c) for c in RAW_CASES))
        await channel.close()
    completions, codes = results[: len(prompts)], results[len(prompts):]
    for prompt, got, ref in zip(prompts, completions, alone):
        assert_same_greedy(prompt, list(got.token_ids), list(ref.token_ids), 12)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in completions)
    assert codes == [c[4] for c in RAW_CASES]
    assert await wait_idle(stack, baseline) == baseline
    assert not per_request_keys_without_ttl(stack)
    assert not dead_services(stack)


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-9])
def test_tiny_temperatures_sample_like_greedy(stack, temperature):
    """A denormal temperature once overflowed logits / T into NaN probabilities and streamed
    garbage (the last vocabulary id, repeated); below 1e-6 the engine now samples greedily."""
    with Client(stack.address, token=TOKEN) as client:
        greedy = client.generate("Once upon a time", max_tokens=8, ignore_eos=True)
        tiny = client.generate("Once upon a time", max_tokens=8, ignore_eos=True, temperature=temperature, seed=1)
    assert tiny.token_ids == greedy.token_ids
