"""OpenAI request bodies -> the gateway's RequestFields, or an InvalidArgument naming the field.

Every field a client may send is in one of three tables: supported (mapped to the engine's
parameters), accepted only at its neutral value (``n`` = 1, penalties 0, no logprobs, ...: a
client that asks for more is refused, never silently served less), or refused outright.
A field in none of them is refused as unknown. JSON ``null`` means "not sent", as in OpenAI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidArgument
from gateway.validation import RequestFields


@dataclass(frozen=True)
class OpenAIRequest:
    fields: RequestFields
    model: str | None
    stream: bool
    include_usage: bool
    messages: list[dict[str, str]] | None  # chat only, each {"role", "content"} with text content


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Accepted only at these values (the engine has no other): anything else is a 400 naming the field.
NEUTRAL: dict[str, Any] = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v == 1,
    "presence_penalty": lambda v: _is_number(v) and v == 0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0,
    "repetition_penalty": lambda v: _is_number(v) and v == 1,
    "min_p": lambda v: _is_number(v) and v == 0,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "echo": lambda v: v is False,
    "logit_bias": lambda v: v == {},
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # meaningless without tools
    "tool_choice": lambda v: v == "none",
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
    "store": lambda v: v is False,
}
WHAT = {  # what the engine lacks, for the 400's message
    "n": "one completion per request (send n=1 or several requests)",
    "best_of": "one candidate per request",
    "logprobs": "no log-probabilities", "top_logprobs": "no log-probabilities",
    "echo": "no prompt echo", "suffix": "no insertion (suffix)",
    "tools": "no tool calling", "tool_choice": "no tool calling", "response_format": "no structured output",
}
ACCEPTED = {"user", "metadata"}  # only identify the caller; nothing to compute
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "ignore_eos", "request_id"}
COMPLETION = COMMON | {"prompt"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
ROLES = ("system", "user", "assistant", "developer")


def parse(body: Any, *, chat: bool) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    known = CHAT if chat else COMPLETION
    for name, value in body.items():
        if value is None or name in known or name in ACCEPTED:
            continue
        if name in NEUTRAL:
            if not NEUTRAL[name](value):
                lacks = WHAT.get(name, f"{name} is not implemented by this server's sampler")
                raise InvalidArgument(name, f"unsupported ({lacks}); got {value!r}")
            continue
        raise InvalidArgument(name, "unrecognized or unsupported field")
    get = {k: v for k, v in body.items() if v is not None}.get
    stream = _bool(get("stream", False), "stream")
    include_usage = False
    options = get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidArgument("stream_options", "is only allowed with stream=true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidArgument("stream_options", 'only {"include_usage": bool} is supported')
        include_usage = _bool(options.get("include_usage", False), "stream_options.include_usage")
    model = get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", "must be a string")
    max_tokens = _int(get("max_tokens"), "max_tokens", 1) if get("max_tokens") is not None else 0  # 0 = default
    if chat and get("max_completion_tokens") is not None:
        if get("max_tokens") is not None:
            raise InvalidArgument("max_completion_tokens", "send either max_tokens or max_completion_tokens, not both")
        max_tokens = _int(get("max_completion_tokens"), "max_completion_tokens", 1)
    top_k = _int(get("top_k", 0), "top_k", -1)  # -1 = off, as vLLM spells it
    fields = RequestFields(
        prompt="" if chat else _prompt(get("prompt")),
        max_tokens=max_tokens,
        temperature=_number(get("temperature", 1.0), "temperature"),  # OpenAI's default: 1
        top_p=_number(get("top_p", 1.0), "top_p"),
        top_k=max(top_k, 0),
        seed=_int(get("seed"), "seed", 0) if get("seed") is not None else None,
        stop=_stop(get("stop")),
        ignore_eos=_bool(get("ignore_eos", False), "ignore_eos"),
        request_id=_str(get("request_id", ""), "request_id"),
    )
    messages = _messages(get("messages")) if chat else None
    return OpenAIRequest(fields, model, stream, include_usage, messages)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgument(name, f"must be true or false, got {v!r}")
    return v


def _int(v: Any, name: str, low: int) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise InvalidArgument(name, f"must be an integer >= {low}, got {v!r}")
    return v


def _number(v: Any, name: str) -> float:
    if not _is_number(v):
        raise InvalidArgument(name, f"must be a number, got {v!r}")
    return float(v)


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise InvalidArgument(name, f"must be a string, got {type(v).__name__}")
    return v


def _prompt(v: Any) -> str:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    if isinstance(v, str):
        return v
    if v is None:
        raise InvalidArgument("prompt", "is required")
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
        raise InvalidArgument("prompt", "token-id prompts are not supported; send text")
    raise InvalidArgument("prompt", "must be a string (or a list of exactly one string; batches are not supported)")


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _messages(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content}")
    out = []
    for i, msg in enumerate(v):
        if not isinstance(msg, dict):
            raise InvalidArgument(f"messages[{i}]", "must be an object with role and content")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        extra = set(msg) - {"role", "content", "name"}
        if extra:
            raise InvalidArgument(f"messages[{i}].{sorted(extra)[0]}", "unsupported (no tool calling)")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidArgument(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out
