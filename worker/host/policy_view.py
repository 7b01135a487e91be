"""The worker's local copy of the planner's policy: γ per batch size and the draft's residency
without touching the network. The engine host holds the only PolicyView; the worker service
follows Redis and hands every policy it reads to the host.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol

from nightjar.keys import Keys
from nightjar.messages import MessageError, Policy, Residency
from nightjar.service_util import REDIS_LOST_ERRORS

log = logging.getLogger("worker.policy")
RESIDENCIES = (Residency.RESIDENT.value, Residency.OFFLOADED.value)  # the directives worker.engine.memory carries out
FUTURE_SKEW_S = 1.0  # a stamp further ahead than this is a wrong clock, not NTP jitter
LEFT_EPOCHS_KEPT = 16  # epochs remembered as left (a late message from one is ignored)


class PolicyView:
    """``PolicyView`` holds the newest ``Policy`` it was given and answers ``gamma(batch, now)`` from
    it, or from the worker's own default when the policy is absent, older than its TTL (a dead
    planner never freezes γ at a stale value) or stamped in the future (a planner whose clock runs
    ahead would otherwise be trusted for longer than its TTL). Newest means a higher version of the
    same epoch, or a new epoch (a planner that restarted from a fresh state counts from 1 again);
    an older version, or a policy of an epoch already left, is ignored, so a late pub/sub message
    cannot roll it back. A residency it does not know is logged and ignored (the draft stays
    resident), never handed to the engine. ``follow_policy`` keeps it current: it loads keys.policy at start,
    then follows keys.policy_channel, reloading the key after every (re)subscription so nothing
    published during a Redis blip is missed.

    The engine thread calls ``gamma`` and ``residency`` every step, and ``update`` when the worker
    service forwards a policy; in tests the asyncio side may call ``update`` too. The view only
    ever swaps one reference to an immutable Policy, so no lock is needed.
    """

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
        self._left_epochs: list[str] = []
        self._bogus_logged: tuple[str, int] | None = None

    @property
    def version(self) -> int:
        return self._policy.version if self._policy else -1

    @property
    def epoch_version(self) -> tuple[str, int] | None:
        """What identifies the policy held (a new epoch may restart at a lower version)."""
        return (self._policy.epoch, self._policy.version) if self._policy else None

    @property
    def policy(self) -> Policy | None:
        return self._policy

    def update(self, policy: Policy) -> bool:
        """Adopt ``policy`` if it is newer than the one held; True when adopted."""
        held = self._policy
        if held is not None:
            if policy.epoch == held.epoch:
                if policy.version <= held.version:
                    return False
            elif policy.epoch in self._left_epochs:
                return False
            else:
                log.info("planner epoch %r -> %r (version %d -> %d)", held.epoch, policy.epoch, held.version, policy.version)
                self._left_epochs = [*self._left_epochs[-(LEFT_EPOCHS_KEPT - 1):], held.epoch]
        self._policy = policy
        return True

    def fresh(self, now_s: float) -> bool:
        p = self._policy
        if p is None:
            return False
        ttl = p.ttl_s if self.ttl_s is None else min(p.ttl_s, self.ttl_s)
        # Age by the planner's stamp (hosts are NTP-synced): a policy loaded from the key long
        # after a planner died is stale on arrival, not trusted for another TTL.
        age_s = now_s - p.unix_ms / 1000.0
        return -FUTURE_SKEW_S <= age_s <= ttl

    def gamma(self, batch_size: int, now_s: float) -> int:
        p = self._policy
        if p is None or not self.fresh(now_s):
            return int(self.default_gamma(batch_size))
        return p.gamma_for(batch_size)

    def residency(self, now_s: float) -> str:
        """Directive for this worker: "resident" unless a fresh policy says "offloaded"."""
        p = self._policy
        if p is None or not self.fresh(now_s):
            return Residency.RESIDENT  # a stale planner must not keep the draft away
        wanted = p.residency.get(self.worker_id, Residency.RESIDENT)
        if wanted not in RESIDENCIES:
            if self._bogus_logged != (p.epoch, p.version):  # once per policy, not every poll
                self._bogus_logged = (p.epoch, p.version)
                log.warning("policy v%d: ignoring residency %r for %s (not one of %s)", p.version, wanted,
                            self.worker_id, RESIDENCIES)
            return Residency.RESIDENT
        return wanted


def _decode(data: Any) -> Policy | None:
    try:
        return Policy.decode(data)
    except MessageError as exc:
        log.warning("ignoring an unreadable policy (%s)", exc)
        return None


class PolicySink(Protocol):
    """Where ``follow_policy`` hands each policy it reads: a PolicyView, or the worker service's
    forwarder to the host's view (which decides whether it is newer)."""

    def update(self, policy: Policy) -> Any: ...


async def follow_policy(redis: Any, keys: Keys, view: PolicySink, stop_event: asyncio.Event,
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
        except REDIS_LOST_ERRORS as exc:
            log.warning("policy channel lost (%s); resubscribing", exc)
            try:
                await asyncio.wait_for(stop_event.wait(), timeout=retry_s)
            except asyncio.TimeoutError:
                pass
