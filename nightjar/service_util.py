"""What every service process shares: the environment, the Redis connection, logging, signals.

The environment is read here and only here (``env_defaults``); each service's ``__main__``
turns it plus its argv into one frozen config.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

ENV_PREFIX = "NIGHTJAR_"
MAX_REDIS_CONNECTIONS = 4096  # per client (process); see connect_redis


@dataclass(frozen=True)
class EnvDefaults:
    """Settings that every service can take from the environment (compose.yaml sets them)."""

    redis_url: str = "redis://127.0.0.1:6379/0"  # holds the password: pass it here, not as --redis-url
    key_prefix: str = "nj"
    log_level: str = "INFO"
    log_format: str = "text"  # "text" for people, "json" (one object a line) for log collectors
    metrics_port: int = 0  # 0 = no /metrics endpoint
    metrics_host: str = ""  # interface of /metrics; "" = the service's default (the gateway's --host, else loopback)
    auth_token: str = ""  # gateway bearer token; empty = auth off


def env_defaults(environ: Mapping[str, str] | None = None) -> EnvDefaults:
    """Read NIGHTJAR_REDIS_URL, NIGHTJAR_KEY_PREFIX, NIGHTJAR_LOG_LEVEL, NIGHTJAR_LOG_FORMAT,
    NIGHTJAR_METRICS_PORT, NIGHTJAR_METRICS_HOST, NIGHTJAR_AUTH_TOKEN. Command-line flags override
    these; secrets (the URL's password, the token) belong here rather than on a command line."""
    env = os.environ if environ is None else environ
    base = EnvDefaults()
    port = env.get(ENV_PREFIX + "METRICS_PORT", str(base.metrics_port))
    try:
        metrics_port = int(port)
    except ValueError:
        raise ValueError(f"NIGHTJAR_METRICS_PORT must be an integer port, got {port!r}") from None
    return EnvDefaults(
        redis_url=env.get(ENV_PREFIX + "REDIS_URL", base.redis_url),
        key_prefix=env.get(ENV_PREFIX + "KEY_PREFIX", base.key_prefix),
        log_level=env.get(ENV_PREFIX + "LOG_LEVEL", base.log_level),
        log_format=env.get(ENV_PREFIX + "LOG_FORMAT", base.log_format),
        metrics_port=metrics_port,
        metrics_host=env.get(ENV_PREFIX + "METRICS_HOST", base.metrics_host),
        auth_token=env.get(ENV_PREFIX + "AUTH_TOKEN", base.auth_token),
    )


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")  # Redis Cluster: docs/reliability.md
_HASH_TAG_PREFIX = re.compile(r"\{[^{}]+\}")  # as nightjar.keys.Keys accepts it


def check_redis_url(url: str, key_prefix: str | None = None) -> str:
    """``url`` if it is one the services can use; with ``key_prefix``, a cluster URL also needs a
    hash-tag prefix (``{nj}``), since Cluster refuses multi-key commands across slots."""
    if not url.startswith(REDIS_SCHEMES + CLUSTER_SCHEMES):
        raise ValueError("redis url must start with redis://, rediss:// (TLS), unix://, or redis+cluster:// / "
                         f"rediss+cluster:// (Redis Cluster), got {masked(url)!r}")
    if url.startswith(CLUSTER_SCHEMES):
        _cluster_url_parts(url)  # refuses a malformed node list now, not at the first connect
        if key_prefix is not None and not _HASH_TAG_PREFIX.fullmatch(key_prefix):
            raise ValueError(f"on Redis Cluster the key prefix must be a hash tag such as '{{{key_prefix or 'nj'}}}', "
                             f"so that every key of the stack is in one slot; got {key_prefix!r}")
    return url


def is_cluster_url(url: str) -> bool:
    """A ``redis+cluster://`` or ``rediss+cluster://`` URL: the services use redis-py's cluster client."""
    return url.startswith(CLUSTER_SCHEMES)


def is_cluster_client(redis) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(redis, RedisCluster)


async def write_and_publish(redis, write: Callable[[Any], None], channel: str, message: bytes, *,
                            transaction: bool = False) -> None:
    """``write(pipe)`` and a PUBLISH in one round trip. A Cluster pipeline refuses PUBLISH (it has
    no key), so there the message goes right after the pipeline, in the same order."""
    cluster = is_cluster_client(redis)
    async with redis.pipeline(transaction=transaction) as pipe:
        write(pipe)
        if not cluster:
            pipe.publish(channel, message)
        await pipe.execute()
    if cluster:
        await redis.publish(channel, message)


def _split_hosts(url: str) -> tuple[str, str, str]:
    """``scheme://[creds@]hosts[/db][?opts]`` -> ("scheme://creds@", hosts, "/db?opts")."""
    scheme, _, rest = url.partition("://")
    creds, at, hostpart = rest.rpartition("@")
    cut = min((i for i in (hostpart.find("/"), hostpart.find("?")) if i >= 0), default=len(hostpart))
    return f"{scheme}://{creds}{at}", hostpart[:cut], hostpart[cut:]


def _cluster_url_parts(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis+cluster://[user:pw@]host:port[,host:port...][/0][?opts]`` -> (a redis:// URL of the
    first node, for the credentials, TLS and options; every node as (host, port), the seeds)."""
    head, hosts, tail = _split_hosts(url)
    nodes = []
    for h in hosts.split(","):
        host, colon, port = h.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"redis cluster url: each node must be host:port, got {h!r} in {masked(url)!r}")
        nodes.append((host, int(port)))
    if tail.split("?", 1)[0] not in ("", "/", "/0"):
        raise ValueError(f"redis cluster url: Cluster has only database 0, got {masked(url)!r}")
    return f"{head.replace('+cluster://', '://', 1)}{nodes[0][0]}:{nodes[0][1]}{tail}", nodes


def node_url(url: str, host: str, port: int) -> str:
    """A single-node ``redis://`` (or ``rediss://``) URL of one cluster node, with ``url``'s
    credentials and options."""
    head, _, tail = _split_hosts(_cluster_url_parts(url)[0])
    return f"{head}{host}:{port}{tail}"


def masked(url: str) -> str:
    """The URL with any password replaced, fit for a log line or an error message."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


LOST_CONNECTION_RETRIES = 3


def connect_redis(url: str, *, timeout_s: float = 1.0, block_margin_s: float = 5.0,
                  retries: int | None = None) -> aioredis.Redis:
    """An asyncio client for ``url`` (password and TLS come from the URL: rediss://:pw@host).

    ``timeout_s`` bounds connecting, so an unreachable Redis fails fast instead of hanging a
    request; reads may block for ``block_margin_s`` because XREAD BLOCK waits on purpose.
    A ``redis+cluster://`` URL gives redis-py's cluster client (``RedisCluster``), which follows
    MOVED/ASK and re-reads the topology after a failover; its API is the same for what the
    services call, as long as every key of a command shares one slot (a ``{tag}`` key prefix).
    ``retries``: how often a command is retried on a lost connection (None: ``LOST_CONNECTION_RETRIES``,
    with a short backoff, on one node; the cluster client's own default on Cluster; a poll that is
    its own retry loop wants 0). Only a lost connection is retried, never a timeout: after a Redis
    restart every pooled connection is dead, and the first command on each must reconnect rather
    than fail its request. (redis-py's ``from_url`` gives pooled connections no retry at all,
    unlike its constructor's default of 10.)
    """
    kw = dict(
        socket_connect_timeout=timeout_s,
        socket_timeout=block_margin_s,
        health_check_interval=10,
        # Every streaming request holds a connection in XREAD BLOCK; redis-py 8 turns None into
        # 100, which failed the 101st concurrent stream with "Too many connections". The gateway's
        # stream cap (--max-streams, 1024) is what bounds this; Redis allows 10 000 clients.
        # (Per node on Cluster.)
        max_connections=MAX_REDIS_CONNECTIONS,
    )
    if is_cluster_url(check_redis_url(url)):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        # The cluster client's own retry (10, with backoff, on connection, timeout and
        # cluster-down errors) is what rides out a failover: keep it unless told otherwise.
        if retries is not None:
            kw["retry"] = Retry(NoBackoff(), retries)
        first, nodes = _cluster_url_parts(url)
        return RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **kw)
    backoff = NoBackoff() if retries is not None else ExponentialWithJitterBackoff(base=0.01, cap=0.25)
    retries = LOST_CONNECTION_RETRIES if retries is None else retries
    kw["retry"] = Retry(backoff, retries, supported_errors=(RedisConnectionError,))
    return aioredis.Redis.from_url(url, **kw)


def connect_redis_sync(url: str, **kw: Any):
    """A blocking client for ``url`` (tools and tests): ``redis.Redis``, or ``redis.RedisCluster``
    for a ``redis+cluster://`` URL."""
    import redis

    if is_cluster_url(check_redis_url(url)):
        first, nodes = _cluster_url_parts(url)
        return redis.RedisCluster.from_url(first, startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in nodes[1:]], **kw)
    return redis.Redis.from_url(url, **kw)


class SlotNode:
    """On Redis Cluster, single-node clients of the primary that owns ``key``'s slot (the whole
    stack's slot, given a ``{tag}`` prefix): for what the cluster client cannot route, a blocking
    read on one connection of its own that another connection interrupts with CLIENT UNBLOCK
    (gateway.output_reader). ``clients()`` asks the cluster client where the slot is now, so
    calling it again after an error follows a failover or a resharding."""

    def __init__(self, url: str, cluster, key: str, *, timeout_s: float, block_margin_s: float) -> None:
        self._url, self._cluster, self._key = url, cluster, key
        self._timeout_s, self._block_margin_s = timeout_s, block_margin_s
        self._at: tuple[str, int] | None = None
        self._clients: tuple[aioredis.Redis, aioredis.Redis] | None = None

    async def clients(self) -> tuple[aioredis.Redis, aioredis.Redis]:
        """(single-connection reader, pooled control client), both on the slot's primary now."""
        await self._cluster.initialize()
        node = self._cluster.get_node_from_key(self._key)
        at = (node.host, node.port)
        if self._clients is None or at != self._at:
            await self.aclose()
            url = node_url(self._url, *at)
            reader = aioredis.Redis.from_url(url, single_connection_client=True, socket_connect_timeout=self._timeout_s,
                                             socket_timeout=self._block_margin_s)
            control = aioredis.Redis.from_url(url, socket_connect_timeout=self._timeout_s, socket_timeout=self._block_margin_s)
            self._at, self._clients = at, (reader, control)
        return self._clients

    async def aclose(self) -> None:
        if self._clients is not None:
            for c in self._clients:
                await c.aclose()
            self._clients = None


# What a loop that must outlive a lost connection catches. When a node dies while redis-py
# (re)connects or writes (a Cluster primary SIGKILLed), the write on a transport uvloop has
# already closed raises RuntimeError ("unable to perform operation on <TCPTransport
# closed=True>; the handler is closed"), not ConnectionError: it ended the worker's policy and
# output tasks, so the worker stopped. Every service's Redis retry loop catches this.
REDIS_LOST_ERRORS = (RedisError, OSError, RuntimeError)

REDIS_RETRY_FIRST_S = 0.25
REDIS_RETRY_MAX_S = 5.0


def redis_where(redis: aioredis.Redis) -> str:
    """host:port (or socket path) of a client, without the password that the URL may hold."""
    if not hasattr(redis, "connection_pool"):  # RedisCluster: its seed nodes
        nodes = getattr(getattr(redis, "nodes_manager", None), "startup_nodes", {}) or {}
        return "cluster " + ",".join(nodes) if nodes else "cluster"
    kw = redis.connection_pool.connection_kwargs
    return kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"


async def wait_for_redis(redis: aioredis.Redis, stop: asyncio.Event, log: logging.Logger) -> bool:
    """Until Redis answers (True) or ``stop`` is set (False), retrying with backoff and saying why.

    Services start in any order (compose starts them together, a host reboots, Redis restarts
    slower than a worker): one that exits because Redis is not up yet needs someone to start
    it again, and one that retries silently looks hung.
    """
    delay = REDIS_RETRY_FIRST_S
    while not stop.is_set():
        try:
            await redis.ping()
            if delay > REDIS_RETRY_FIRST_S:
                log.info("Redis at %s answers", redis_where(redis))
            return True
        except REDIS_LOST_ERRORS as exc:
            log.warning("waiting for Redis at %s (%s: %s); retrying in %.1fs", redis_where(redis),
                        type(exc).__name__, exc, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass
        delay = min(REDIS_RETRY_MAX_S, delay * 2)
    return False


async def stop_tasks(tasks: list[asyncio.Task], log: logging.Logger, timeout_s: float = 5.0) -> None:
    """Cancel a service's loops and wait for them, at most ``timeout_s``: a cancel can be
    swallowed inside a Redis call (the redis-py bug class of redis/redis-py#2028), and a drain
    must not wait on such a loop for good. One still running is named and left behind."""
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in done:  # read, as gather(return_exceptions=True) would: the caller reports the one that mattered
        if not t.cancelled():
            t.exception()
    if pending:
        log.warning("%s did not stop within %.0f s of its cancel; leaving it", ", ".join(t.get_name() for t in pending), timeout_s)


def now_ms() -> int:
    return int(time.time() * 1000)


LOG_FORMATS = ("text", "json")
# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (unix seconds), level, service, logger, msg, then the
    record's ``extra`` fields, and ``exc`` with the traceback when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 6), "level": record.levelname, "service": self.service,
               "logger": record.name, "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def setup_logging(level: str, service: str, fmt: str = "text") -> logging.Logger:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json"
                         else logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    return logging.getLogger(service)


def install_stop_handlers(loop: asyncio.AbstractEventLoop, on_stop: Callable[[str], None]) -> None:
    """Call ``on_stop(signal_name)`` on SIGINT/SIGTERM (inside the loop, never re-entrantly)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop, sig.name)


def run_async(main: Callable[[], "asyncio.Future | object"]) -> int:
    """Run ``main()`` (a coroutine function) on uvloop and return its exit code."""
    try:
        import uvloop

        return int(uvloop.run(main()) or 0)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return int(asyncio.run(main()) or 0)


def service_main(name: Callable[[Any], str] | str, parse_config: Callable[[list[str]], Any],
                 serve: Callable[[Any], Any], argv: list[str] | None) -> int:
    """A service's ``main``: its config from argv, logging named ``name`` (or ``name(cfg)``), then ``serve(cfg)``."""
    cfg = parse_config(list(sys.argv[1:] if argv is None else argv))
    setup_logging(cfg.log_level, name(cfg) if callable(name) else name, cfg.log_format)
    return run_async(lambda: serve(cfg))


def add_common_args(parser, env: EnvDefaults) -> None:
    """The flags every service takes; their defaults come from the environment."""
    parser.add_argument("--redis-url", default=env.redis_url,
                        help="redis:// or rediss:// (TLS) URL, redis+cluster://host:port[,host:port] for Redis Cluster; "
                             "password inside: pass it as env NIGHTJAR_REDIS_URL, since a command line is visible to "
                             "every local user")
    parser.add_argument("--key-prefix", default=env.key_prefix, help="prefix of every Redis key (env NIGHTJAR_KEY_PREFIX)")
    parser.add_argument("--log-level", default=env.log_level, help="DEBUG, INFO, WARNING (env NIGHTJAR_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=env.log_format,
                        help="text, or json for one object a line (env NIGHTJAR_LOG_FORMAT)")
    parser.add_argument("--metrics-port", type=int, default=env.metrics_port, help="Prometheus /metrics port, 0 = off (env NIGHTJAR_METRICS_PORT)")
    parser.add_argument("--metrics-host", default=env.metrics_host or None,
                        help="interface of /metrics (env NIGHTJAR_METRICS_HOST; default: the gateway's --host, "
                             "127.0.0.1 for the other services)")


async def run_redis_loop(name: str, cfg, make_service: Callable[[aioredis.Redis], object]) -> int:
    """Serve metrics, then run ``make_service(redis).run(stop)`` until SIGTERM/SIGINT.

    A service whose Redis is not up yet (compose starts everything at once) or goes away
    waits for it (``wait_for_redis``) and is rebuilt and rerun, rather than exiting; a run that
    keeps failing right away backs off the same way. ``cfg`` needs ``metrics_port``,
    ``redis_url`` and ``read_block_ms``.
    """
    from nightjar import metrics

    log = logging.getLogger(name)
    metrics.use(name)
    metrics.serve(cfg.metrics_port, cfg.metrics_host)
    redis = connect_redis(cfg.redis_url, block_margin_s=cfg.read_block_ms / 1000 + 5.0)
    stop = asyncio.Event()
    install_stop_handlers(asyncio.get_running_loop(), lambda _sig: stop.set())
    delay = REDIS_RETRY_FIRST_S
    while await wait_for_redis(redis, stop, log):
        started = time.monotonic()
        try:
            await make_service(redis).run(stop)
        except REDIS_LOST_ERRORS as exc:
            if time.monotonic() - started > 30:  # it ran a while: a new outage, not a failing start
                delay = REDIS_RETRY_FIRST_S
            log.warning("Redis failed under the %s (%s: %s); restarting it in %.1fs", name, type(exc).__name__, exc, delay)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(REDIS_RETRY_MAX_S, delay * 2)
        else:
            break
    await redis.aclose()
    return 0
