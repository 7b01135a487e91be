"""The planner's loop: worker StepStats in (consumer group), versioned Policy out (SET + PUBLISH).

    read a batch of stats (XREADGROUP, own pending entries first after a restart)
    → policy.update(each) → XACK → publish if the table/residency changed or ttl/3 passed
    → save state (nightjar.messages.PlannerState) to keys.planner_state now and then

While keys.planner_hold holds a messages.PolicyHold, the planner publishes that static policy
instead of its own and learns nothing from the steps run under it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from nightjar.keys import Keys
from nightjar.messages import MessageError, PlannerState, Policy, PolicyHold, StepStats
from nightjar.service_util import REDIS_LOST_ERRORS, write_and_publish
from nightjar.streams import ensure_group
from planner_svc.config import PlannerConfig
from planner_svc.policies import GammaPolicy, make_policy, make_static_policy

log = logging.getLogger("planner")
STATS_FIELD = b"s"  # worker.service.loops writes XADD keys.stats {b"s": StepStats.encode()}
VERSION_LIMIT = 2**63 - 1  # signed 64-bit, so any reader's integer type holds it
HOLD_CHECK_S = 0.2  # how often keys.planner_hold is read: a GET, beside a read of up to 512 stats


def new_epoch() -> str:
    return secrets.token_hex(8)


def now_ms() -> int:
    return int(time.time() * 1000)



def encode_state(cfg: PlannerConfig, version: int, policy: GammaPolicy, epoch: str = "") -> bytes:
    return PlannerState(PlannerState.FORMAT, version, cfg.policy, cfg.gamma_max, tuple(cfg.buckets),
                        policy.state_dict(), epoch, now_ms()).encode()


class PlannerService:
    """A bad entry is logged and acknowledged, never retried forever. The version only grows within
    an epoch (nightjar.messages.Policy): a restarted planner resumes its saved epoch and starts
    above both its saved version and the one currently published; one that starts from a fresh
    state draws a new epoch, which workers adopt whatever its version. A version that reaches
    ``VERSION_LIMIT`` starts a new epoch at 1 instead of overflowing msgpack's 64-bit integers
    (which failed every publish: the planner exited, restarted above the same version, and
    failed again). It never sits on a worker's hot path: workers look γ up in the table they
    already hold.
    """

    def __init__(self, config: PlannerConfig, redis: Any) -> None:
        self.cfg = config
        self.redis = redis
        self.keys = Keys(config.key_prefix)
        self.policy: GammaPolicy = make_policy(config.policy, gamma_max=config.gamma_max, seed=config.seed,
                                               buckets=config.buckets)
        prior = config.surface_prior()
        if prior is not None:  # a saved state, when one is resumed, replaces it (start())
            self.policy.warm_start(prior)
        self.version = 0
        self.epoch = new_epoch()  # replaced by the saved one when the saved state is resumed
        self.published: tuple[tuple[int, ...], dict[str, str]] | None = None
        self.published_at = 0.0
        self.published_policy: Policy | None = None
        self.saved_at = 0.0
        self.processed = 0
        self.rejected = 0
        self._pending_first = True  # after a restart, re-read what we took but never acknowledged
        self.hold: tuple[bytes, GammaPolicy] | None = None  # (the key's bytes, the static policy in force)
        self.held_steps = 0  # stats read and not learned from: run under a hold
        self._hold_checked_at = -HOLD_CHECK_S
        self._learn_from_ms = 0  # stats stamped before this ran under a hold just lifted
        self._bad_hold: bytes | None = None

    async def start(self) -> None:
        await ensure_group(self.redis, self.keys.stats, self.keys.planner_group)
        await self._load_state()

    async def _load_state(self) -> None:
        raw = await self.redis.get(self.keys.planner_state)
        current = await self.redis.get(self.keys.policy)
        if current:
            try:
                self.version = max(self.version, Policy.decode(current).version)
            except MessageError:
                log.warning("the published policy is unreadable; it will be replaced")
        if not raw:
            return
        try:
            saved = PlannerState.decode(raw)
            self.version = max(self.version, saved.version)
            if (saved.policy, saved.gamma_max, saved.buckets) == (self.cfg.policy, self.cfg.gamma_max,
                                                                    tuple(self.cfg.buckets)):
                self.policy.load_state_dict(saved.state)
                if saved.epoch:
                    self.epoch = saved.epoch
                log.info("resumed %s from saved state (epoch %s, version %d)", self.cfg.policy, self.epoch, self.version)
            else:
                log.info("saved state is for another policy/config; starting fresh at version %d", self.version)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("saved planner state unreadable (%s); starting fresh", exc)

    async def save_state(self) -> None:
        await self.redis.set(self.keys.planner_state, encode_state(self.cfg, self.version, self.policy, self.epoch))
        self.saved_at = time.monotonic()

    @property
    def in_force(self) -> GammaPolicy:
        """The policy published: a hold's while one lives, else the planner's own."""
        return self.hold[1] if self.hold else self.policy

    def current_policy(self) -> Policy:
        p = self.in_force
        return Policy(version=self.version, unix_ms=now_ms(), ttl_s=self.cfg.ttl_s,
                      bucket_upper_bounds=self.policy.buckets, gamma_by_bucket=p.table(),
                      residency=p.residency(), name=f"hold:{p.name}" if self.hold else p.name, epoch=self.epoch)

    async def check_hold(self) -> None:
        """Follow keys.planner_hold. The version and epoch stay the planner's own either way, so
        workers take the hold and the release as any newer policy. A hold that is not a static
        policy spec is logged once and counts as none."""
        raw = await self.redis.get(self.keys.planner_hold)
        if raw is not None and raw != (self.hold[0] if self.hold else None):
            held = self._read_hold(raw)
            if held is not None:
                log.info("holding %s in place of %s", held.name, self.policy.name)
                self.hold = (raw, held)
                await self.publish(force=True)
                return
            raw = None
        if raw is None and self.hold is not None:
            log.info("hold on %s lifted; publishing %s again", self.hold[1].name, self.policy.name)
            self.hold, self._learn_from_ms = None, now_ms()
            await self.publish(force=True)

    def _read_hold(self, raw: bytes) -> GammaPolicy | None:
        try:
            return make_static_policy(PolicyHold.decode(raw).policy, gamma_max=self.cfg.gamma_max,
                                      buckets=self.policy.buckets)
        except (MessageError, ValueError) as exc:
            if raw != self._bad_hold:
                self._bad_hold = raw
                log.warning("ignoring the hold in %s: %s", self.keys.planner_hold, exc)
            return None

    async def publish(self, force: bool = False) -> bool:
        """SET + PUBLISH a new version if the decision changed or a refresh is due."""
        decision = (self.in_force.table(), self.in_force.residency())
        changed = decision != self.published
        due = time.monotonic() - self.published_at >= self.cfg.republish_s
        if not (force or due or changed):
            return False
        if self.version >= VERSION_LIMIT:
            old, self.epoch, self.version = self.epoch, new_epoch(), 0
            log.warning("policy version reached %d; epoch %s -> %s, counting from 1 again", VERSION_LIMIT, old, self.epoch)
        self.version += 1
        policy = self.current_policy()
        blob = policy.encode()
        # workers reload the key on every resubscription, so the SET goes first
        await write_and_publish(self.redis, lambda pipe: pipe.set(self.keys.policy, blob), self.keys.policy_channel,
                                blob, transaction=True)
        self.published, self.published_at = decision, time.monotonic()
        self.published_policy = policy
        try:
            from nightjar import metrics

            metrics.POLICY_VERSION.set(self.version)
        except ImportError:  # pragma: no cover - metrics is part of the package
            pass
        if changed:
            log.debug("policy v%d: %s %s", self.version, decision[0], decision[1])
        # No state save here: a restarted planner starts above the published version anyway.
        return True

    def _apply(self, fields: dict) -> None:
        try:
            stats = StepStats.decode(fields[STATS_FIELD])
        except (KeyError, MessageError) as exc:
            self.rejected += 1
            log.warning("bad stats entry (%s); acknowledged and skipped", exc)
            return
        if self.hold is not None or stats.unix_ms < self._learn_from_ms:
            self.held_steps += 1
            return
        self.policy.update(stats)
        self.processed += 1

    async def step_once(self, block_ms: int | None = None) -> int:
        """Read one batch of stats, learn from it, acknowledge it, publish if due. Returns entries read."""
        start = "0" if self._pending_first else ">"
        block = None if self._pending_first else (self.cfg.read_block_ms if block_ms is None else block_ms)
        reply = await self.redis.xreadgroup(self.keys.planner_group, self.cfg.consumer, {self.keys.stats: start},
                                            count=self.cfg.read_count, block=block)
        entries = reply[0][1] if reply else []
        if self._pending_first and not entries:
            self._pending_first = False
        ids = []
        for entry_id, fields in entries:
            ids.append(entry_id)
            if fields:  # a pending entry deleted by MAXLEN trimming comes back with no fields
                self._apply(fields)
        if ids:
            await self.redis.xack(self.keys.stats, self.keys.planner_group, *ids)
        if time.monotonic() - self._hold_checked_at >= HOLD_CHECK_S:
            self._hold_checked_at = time.monotonic()
            await self.check_hold()
        await self.publish()
        if time.monotonic() - self.saved_at >= self.cfg.save_interval_s and entries:
            await self.save_state()
        return len(entries)

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await self.publish(force=True)
        log.info("planner up: policy %s, version %d, buckets %s", self.policy.name, self.version, self.cfg.buckets)
        while not stop.is_set():
            began = time.monotonic()
            try:
                if await self.step_once():
                    await asyncio.sleep(max(0.0, self.cfg.read_interval_ms / 1000.0 - (time.monotonic() - began)))
            except REDIS_LOST_ERRORS as exc:
                log.warning("redis error (%s); retrying", exc)
                if "NOGROUP" in str(exc):  # Redis came back empty: recreate the stats group
                    self._pending_first = True
                    try:
                        await ensure_group(self.redis, self.keys.stats, self.keys.planner_group)
                    except REDIS_LOST_ERRORS:
                        pass
                await asyncio.sleep(0.5)
        try:
            await self.save_state()
        except REDIS_LOST_ERRORS:
            log.warning("could not save state on the way out")
