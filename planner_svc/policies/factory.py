"""``make_policy(spec)``: the one place a policy name on a command line becomes an object.

Specs: ``nightjar``, ``nightjar-nooffload``, ``off``, ``fixed:G``, ``threshold:B`` (or
``threshold:B:G``; γ = G, default min(3, γmax), up to batch B, then 0), ``table:1=4,4=2,16=1,32=0``
(γ of the smallest listed batch size >= B; past the largest, its value), ``ucb``, ``heuristic``,
``ema`` (SGLang's --speculative-adaptive).
"""

from __future__ import annotations

from dataclasses import replace

from planner_svc.policies.base import DEFAULT_BUCKETS, GammaPolicy
from planner_svc.policies.ema import EmaPolicy
from planner_svc.policies.heuristic import HeuristicPolicy
from planner_svc.policies.nightjar import NightjarPolicy, NightjarSettings
from planner_svc.policies.static import StaticPolicy, StaticSettings
from planner_svc.policies.ucb import UcbPolicy

SPECS = ("nightjar", "nightjar-nooffload", "off", "fixed:G", "threshold:B[:G]", "table:B=G,...", "ucb", "heuristic", "ema")


def _int(text: str, what: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"policy {spec!r}: {what} must be an integer, got {text!r}") from None


def make_policy(spec: str, *, gamma_max: int, seed: int = 0, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                settings: NightjarSettings | None = None) -> GammaPolicy:
    spec = spec.strip()
    name, _, arg = spec.partition(":")
    if name in ("nightjar", "nightjar-nooffload") and not arg:
        s = settings or NightjarSettings()
        if name == "nightjar-nooffload":
            s = replace(s, offload=False)
        policy = NightjarPolicy(s, gamma_max=gamma_max, seed=seed, buckets=buckets)
        policy.name = name
        return policy
    if name == "off" and not arg:
        return StaticPolicy(StaticSettings((1,), (0,)), gamma_max=gamma_max, name="off", buckets=buckets)
    if name == "fixed" and arg:
        g = _int(arg, "gamma", spec)
        if not 0 <= g <= gamma_max:
            raise ValueError(f"policy {spec!r}: gamma must be in 0..{gamma_max}")
        return StaticPolicy(StaticSettings((1,), (g,)), gamma_max=gamma_max, name=spec, buckets=buckets)
    if name == "threshold" and arg:
        parts = arg.split(":")
        if len(parts) > 2:
            raise ValueError(f"policy {spec!r}: expected threshold:B or threshold:B:G")
        b = _int(parts[0], "batch size", spec)
        g = _int(parts[1], "gamma", spec) if len(parts) == 2 else min(3, gamma_max)
        if b < 1 or not 0 <= g <= gamma_max:
            raise ValueError(f"policy {spec!r}: need B >= 1 and 0 <= G <= {gamma_max}")
        return StaticPolicy(StaticSettings((b, b + 1), (g, 0)), gamma_max=gamma_max, name=spec, buckets=buckets)
    if name == "table" and arg:
        pairs = []
        for item in arg.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"policy {spec!r}: entries must look like 'batch=gamma', got {item!r}")
            pairs.append((_int(key, "batch size", spec), _int(value, "gamma", spec)))
        pairs.sort()
        return StaticPolicy(StaticSettings(tuple(k for k, _ in pairs), tuple(v for _, v in pairs)),
                            gamma_max=gamma_max, name=spec, buckets=buckets)
    if name == "ucb" and not arg:
        return UcbPolicy(gamma_max=gamma_max, buckets=buckets)
    if name == "heuristic" and not arg:
        return HeuristicPolicy(gamma_max=gamma_max, buckets=buckets)
    if name == "ema" and not arg:
        return EmaPolicy(gamma_max=gamma_max, buckets=buckets)
    raise ValueError(f"unknown policy spec {spec!r}; expected one of: {', '.join(SPECS)}")


def make_static_policy(spec: str, *, gamma_max: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> StaticPolicy:
    """``make_policy`` for a spec that learns nothing (off, fixed:G, threshold:, table:): what a
    planner hold may publish (nightjar.messages.PolicyHold). ValueError otherwise."""
    policy = make_policy(spec, gamma_max=gamma_max, buckets=buckets)
    if not isinstance(policy, StaticPolicy):
        raise ValueError(f"{spec!r} learns; a hold is a static policy: off, fixed:G, threshold:B[:G], table:B=G,...")
    return policy
