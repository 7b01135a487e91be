"""The gateway process: gRPC server (InferenceService, health, reflection), Redis watch, drain."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from gateway.admission import AdmissionTable
from gateway.config import GatewayConfig
from gateway.request_queue import RequestQueue
from gateway.http_server import HTTPServer
from gateway.inference import Inference
from gateway.openai_http import OpenAIFrontEnd
from gateway.output_reader import OutputReader
from gateway.interceptors import ErrorInterceptor
from gateway.servicer import InferenceServicer
from nightjar.dispatch_lease import DirectDispatch
from nightjar.keys import Keys
from nightjar.service_util import SlotNode, connect_redis, is_cluster_url
from nightjar.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("gateway")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def load_tokenizer(cfg: GatewayConfig):
    from transformers import AutoTokenizer  # heavy import: only when a gateway really starts

    return AutoTokenizer.from_pretrained(str(cfg.target_path))


def _read(path) -> str | None:
    return path.read_text() if path is not None else None


# Request metadata (headers, the bearer token among them) up to 16 KiB, larger refused. Soft =
# hard on purpose: gRPC rejects requests *at random* between a soft limit (8 KiB by default)
# and the hard one (16 KiB), so an 8 kB token passed or failed by chance.
METADATA_LIMITS = (("grpc.max_metadata_size", 16 * 1024), ("grpc.absolute_max_metadata_size", 16 * 1024))


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer=None) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.key_prefix)
        self._tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        self._redis = connect_redis(cfg.redis_url, timeout_s=cfg.redis_timeout_s,
                                    block_margin_s=cfg.read_block_ms / 1000 + 5.0)
        # A separate client for the health poll, with a short read timeout: a hung Redis
        # must turn the gateway NOT_SERVING quickly, not after a blocking read's margin. No
        # client-side retries: the poll is the retry loop, and redis-py's backoff (up to 1 s a
        # try) held the gateway refusing requests for seconds after Redis was back.
        self._probe = connect_redis(cfg.redis_url, timeout_s=cfg.redis_timeout_s, block_margin_s=cfg.redis_timeout_s,
                                    retries=0)
        self.table = AdmissionTable(cfg.max_streams, cfg.max_queued, cfg.retry_after_ms, recheck=self._redis_back)
        self._recheck: asyncio.Future[bool] | None = None
        # One connection of its own for the shared XREAD, so CLIENT UNBLOCK targets only it; on
        # Cluster, on the node that owns the stack's slot (the one all its output streams share).
        self._reader_redis: aioredis.Redis | None = None
        self._pin: SlotNode | None = None
        if is_cluster_url(cfg.redis_url):
            self._pin = SlotNode(cfg.redis_url, self._redis, self.keys.data_mark, timeout_s=cfg.redis_timeout_s,
                                 block_margin_s=cfg.read_block_ms / 1000 + 5.0)
        else:
            self._reader_redis = aioredis.Redis.from_url(cfg.redis_url, single_connection_client=True,
                                                         socket_connect_timeout=cfg.redis_timeout_s,
                                                         socket_timeout=cfg.read_block_ms / 1000 + 5.0)
        self.reader = OutputReader(self._redis, self._reader_redis, cfg.read_block_ms,
                                   data_mark_key=self.keys.data_mark, retry_s=cfg.redis_outage_s, pin=self._pin)
        direct = DirectDispatch(self._redis, self.keys, cfg.assignment_ttl_s) if cfg.direct_dispatch else None
        self.queue = RequestQueue(self._redis, self.keys, self.reader, cancel_ttl_s=cfg.cancel_ttl_s, direct=direct)
        self.inference = Inference(cfg, self._tokenizer, self.queue, self.table)
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._watch_task: asyncio.Task | None = None
        self.http: HTTPServer | None = None
        self.http_port = 0
        self._status: int | None = None

    async def start(self) -> int:
        # A message may carry the longest prompt that could fit the context, and then some fields.
        max_message = max(4 << 20, self.inference.limits.max_prompt_bytes + (64 << 10))
        server = grpc.aio.server(interceptors=[ErrorInterceptor(self.cfg.auth_token)],
                                 options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message),
                                          *METADATA_LIMITS])
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.inference), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        self.port = server.add_insecure_port(self.cfg.address if self.cfg.port else f"{self.cfg.host}:0")
        if not self.port:
            raise RuntimeError(f"could not listen on {self.cfg.address} (port in use?)")
        await self._set_health(NOT_SERVING)
        await server.start()
        self.server = server
        self.reader.start()
        self._watch_task = asyncio.create_task(self._watch(), name="gateway-watch")
        if self.cfg.http_port is not None:
            front = OpenAIFrontEnd(self.inference, self.cfg.auth_token, self.cfg.model_name, _read(self.cfg.chat_template))
            self.http = HTTPServer(front.app, self.cfg.host, self.cfg.http_port)
            self.http_port = self.http.port
            await self.http.start()
            log.info("OpenAI HTTP API on %s:%d", self.cfg.host, self.http_port)
        log.info("gateway listening on %s:%d (model %s)", self.cfg.host, self.port, self.cfg.model_name)
        return self.port

    async def drain_and_stop(self) -> None:
        """Stop taking requests, let running streams finish for up to the grace period, stop."""
        if self.server is None:
            return
        self.table.draining = True
        await self._set_health(NOT_SERVING)
        n = self.table.in_flight
        if n:
            log.info("draining %d streams (grace %.1fs)", n, self.cfg.drain_grace_s)
            try:
                await asyncio.wait_for(self.table.idle.wait(), self.cfg.drain_grace_s)
            except TimeoutError:
                log.warning("grace period over with %d streams still open; cancelling them", self.table.in_flight)
        await self.server.stop(grace=1.0)  # cancelled handlers publish their cancels
        if self.http is not None:
            await self.http.stop()
        if self._watch_task:
            self._watch_task.cancel()
        await self.queue.drain_background()
        await self.reader.close()
        if self._reader_redis is not None:
            await self._reader_redis.aclose()
        if self._pin is not None:
            await self._pin.aclose()
        await self._redis.aclose()
        await self._probe.aclose()
        self.inference.close()
        self.server = None

    async def wait(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()

    async def _watch(self) -> None:
        """Poll Redis: reachability (fast UNAVAILABLE), backlog (queue cap), live workers (health)."""
        while self.server is not None or not self.table.draining:  # a lost cancel still ends it
            try:
                async with self._probe.pipeline(transaction=False) as pipe:
                    pipe.xlen(self.keys.requests)
                    pipe.smembers(self.keys.workers)
                    backlog, workers = await pipe.execute()
                live = await self._probe.exists(*(self.keys.heartbeat(w.decode()) for w in workers)) if workers else 0
                self.table.redis_ok, self.table.backlog = True, int(backlog)
                ready = live > 0 or not self.cfg.require_worker
            except Exception as exc:  # any Redis failure means: not serving
                if self.table.redis_ok:
                    log.warning("Redis unreachable: %s", exc)
                self.table.redis_ok, ready = False, False
            await self._set_health(SERVING if ready and not self.table.draining else NOT_SERVING)
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _redis_back(self) -> bool:
        """Is Redis reachable now? Asked by a request that meets the last poll's "unreachable",
        so that it is not refused for a poll's interval after Redis came back. One PING at a
        time, shared by the requests that arrive meanwhile."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.ensure_future(self._ping())
        return await asyncio.shield(self._recheck)

    async def _ping(self) -> bool:
        try:
            await self._probe.ping()
            return True
        except Exception:  # any Redis failure means: still unreachable
            return False

    async def _set_health(self, status: int) -> None:
        if status != self._status:
            self._status = status
            await self.health.set("", status)
            await self.health.set(SERVICE_NAME, status)
