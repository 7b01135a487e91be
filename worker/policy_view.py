"""The worker's local copy of the planner's policy: γ per batch size without touching the network.

``PolicyView`` holds the newest ``Policy`` it was given (older versions are ignored, so a late
pub/sub message cannot roll it back) and answers ``gamma(batch, now)`` from it, or from the
worker's own default when the policy is absent or older than its TTL (a dead planner never
freezes γ at a stale value). ``follow_policy`` keeps it current: it loads keys.policy at start,
then follows keys.policy_channel, reloading the key after every (re)subscription so nothing
published during a Redis blip is missed.

The engine thread calls ``gamma`` every step; the asyncio side calls ``update``. The view only
ever swaps one reference to an immutable Policy, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from redis.exceptions import RedisError

from nightjar.keys import Keys
from nightjar.messages import MessageError, Policy

log = logging.getLogger("worker.policy")
RESIDENT = "resident"


class PolicyView:
    def __init__(self, worker_id: str, default_gamma: Callable[[int], int] | int, ttl_s: float | None = None) -> None:
        if isinstance(default_gamma, int):
            if default_gamma < 0:
                raise ValueError(f"default_gamma must be >= 0, got {default_gamma}")
            fixed = default_gamma
            default_gamma = lambda _batch: fixed  # noqa: E731
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (or None to use each policy's own), got {ttl_s}")
        self.worker_id = worker_id
        self.default_gamma = default_gamma
        self.ttl_s = ttl_s  # the worker's cap on staleness; the policy's own ttl_s also applies
        self._policy: Policy | None = None

    @property
    def version(self) -> int:
        return self._policy.version if self._policy else -1

    @property
    def policy(self) -> Policy | None:
        return self._policy

    def update(self, policy: Policy) -> bool:
        """Adopt ``policy`` if it is newer than the one held; True when adopted."""
        if self._policy is not None and policy.version <= self._policy.version:
            return False
        self._policy = policy
        return True

    def fresh(self, now_s: float) -> bool:
        p = self._policy
        if p is None:
            return False
        ttl = p.ttl_s if self.ttl_s is None else min(p.ttl_s, self.ttl_s)
        # Age by the planner's stamp (hosts are NTP-synced): a policy loaded from the key long
        # after a planner died is stale on arrival, not trusted for another TTL.
        return now_s - p.unix_ms / 1000.0 <= ttl

    def gamma(self, batch_size: int, now_s: float) -> int:
        p = self._policy
        if p is None or not self.fresh(now_s):
            return int(self.default_gamma(batch_size))
        return p.gamma_for(batch_size)

    def residency(self, now_s: float) -> str:
        """Directive for this worker: "resident" unless a fresh policy says "offloaded"."""
        p = self._policy
        if p is None or not self.fresh(now_s):
            return RESIDENT  # a stale planner must not keep the draft away
        return p.residency.get(self.worker_id, RESIDENT)


def _decode(data: Any) -> Policy | None:
    try:
        return Policy.decode(data)
    except MessageError as exc:
        log.warning("ignoring an unreadable policy (%s)", exc)
        return None


async def follow_policy(redis: Any, keys: Keys, view: PolicyView, stop_event: asyncio.Event,
                        retry_s: float = 0.5) -> None:
    """Keep ``view`` current until ``stop_event`` is set; survives Redis restarts."""
    while not stop_event.is_set():
        try:
            async with redis.pubsub() as ps:
                await ps.subscribe(keys.policy_channel)
                # Subscribed first, then read the key: a policy published in between is not lost.
                blob = await redis.get(keys.policy)
                if blob and (p := _decode(blob)) is not None:
                    view.update(p)
                while not stop_event.is_set():
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if msg and msg.get("type") == "message" and (p := _decode(msg["data"])) is not None:
                        view.update(p)
        except (RedisError, OSError) as exc:
            log.warning("policy channel lost (%s); resubscribing", exc)
            try:
                await asyncio.wait_for(stop_event.wait(), timeout=retry_s)
            except asyncio.TimeoutError:
                pass
