"""``nightjar queue``: read the live Redis state as tables or JSON; change it only when asked.

    nightjar queue ls | inflight | workers | policy | stats | model | dlq      [--json]
    nightjar queue dlq requeue ID --yes | dlq purge --yes              (the mutations: these,
    nightjar queue hold fixed:2 --for 600 --yes | hold --release --yes   and the planner's hold)
    nightjar queue watch [--interval-s 1] [--iterations N]             (Ctrl-C stops)

Connection: ``--redis-url``, ``--prefix`` and the TLS flags (``--help``); a ``redis+cluster://``
URL (Redis Cluster) goes through the services' own client, with their hash-tag prefix. Exit codes: 0 ok,
1 Redis unreachable, 2 bad usage or a mutation refused (no ``--yes``, unknown id).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import redis
from redis.exceptions import RedisClusterException
from rich.console import Console
from rich.live import Live

from nightjar.keys import Keys
from nightjar.service_util import EnvDefaults, check_redis_url, connect_redis_sync, env_defaults, masked

from . import render
from .mutate import MutationError, hold, purge, requeue
from .reader import QueueReader

VIEWS = {
    "ls": ("waiting requests: age, prompt tokens, max tokens, deliveries", "ls", render.ls_table),
    "inflight": ("requests per worker with progress", "inflight", render.inflight_table),
    "workers": ("per worker: load, batch, γ, draft residency, KV blocks, heartbeat age", "workers",
                render.workers_table),
    "policy": ("the planner's current table and version", "policy", render.policy_view),
    "stats": ("recent step statistics: acceptance per position, step time by γ", "stats", render.stats_view),
    "model": ("what the planner learned: predicted step ms and ms per token by batch bucket and γ", "model",
              render.model_view),
}


def build_parser() -> argparse.ArgumentParser:
    env = env_defaults()
    fmt = argparse.ArgumentDefaultsHelpFormatter
    common = argparse.ArgumentParser(add_help=False, formatter_class=fmt)
    # The URL's default is resolved in main(): a password inside it must not show up in --help.
    common.add_argument("--redis-url", default=None,
                        help="redis:// or rediss:// URL, redis+cluster://host:port[,host:port] for Redis Cluster (with a "
                             f"'{{tag}}' --prefix) (None = env NIGHTJAR_REDIS_URL, else {EnvDefaults().redis_url})")
    common.add_argument("--redis-password", default=None, help="password (overrides one in the URL)")
    common.add_argument("--tls", action="store_true", help="connect with TLS (same as a rediss:// URL)")
    common.add_argument("--tls-ca", default=None, help="CA bundle that signed the server's certificate")
    common.add_argument("--prefix", "--key-prefix", dest="prefix", default=env.key_prefix,
                        help="key prefix (env NIGHTJAR_KEY_PREFIX)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common.add_argument("--limit", type=int, default=1000, help="most rows read per listing")

    p = argparse.ArgumentParser(prog="nightjar queue", description="Inspect Nightjar's Redis queues (read-only "
                                "unless a mutating command is given --yes).", formatter_class=fmt)
    sub = p.add_subparsers(dest="view", required=True, metavar="VIEW")
    for name, (help_, _, _) in VIEWS.items():
        sp = sub.add_parser(name, parents=[common], help=help_, description=help_, formatter_class=fmt)
        if name in ("stats", "workers"):
            sp.add_argument("--window", type=int, default=500, help="recent step records to read")
    dlq = sub.add_parser("dlq", parents=[common], help="dead letters (requeue / purge with --yes)",
                         description="List dead letters; 'requeue ID --yes' or 'purge --yes' change them.",
                         formatter_class=fmt)
    dsub = dlq.add_subparsers(dest="action", metavar="ACTION")
    rq = dsub.add_parser("requeue", parents=[common], help="put a dead-lettered job back in the queue",
                         formatter_class=fmt)
    rq.add_argument("id", help="the dead letter's id (first column of `nightjar queue dlq`)")
    rq.add_argument("--yes", action="store_true", help="really do it (without: say what would happen)")
    pg = dsub.add_parser("purge", parents=[common], help="delete every dead letter", formatter_class=fmt)
    pg.add_argument("--yes", action="store_true", help="really do it (without: say what would happen)")
    h = sub.add_parser("hold", parents=[common], formatter_class=fmt,
                       help="have the planner publish a static policy in place of its own for a while (--yes)",
                       description="The planner publishes SPEC instead of its own policy until the hold expires or "
                                   "is released, and learns nothing from the steps run under it.")
    h.add_argument("spec", nargs="?", help="a static policy: off, fixed:G, threshold:B[:G], table:B=G,...")
    h.add_argument("--for", dest="seconds", type=float, default=600.0, help="seconds until the hold lifts by itself")
    h.add_argument("--release", action="store_true", help="lift the hold now")
    h.add_argument("--yes", action="store_true", help="really do it (without: say what would happen)")
    w = sub.add_parser("watch", parents=[common], help="live dashboard of all views (Ctrl-C stops)",
                       formatter_class=fmt)
    w.add_argument("--interval-s", type=float, default=1.0, help="refresh interval")
    w.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0 = never)")
    w.add_argument("--window", type=int, default=200, help="recent step records to read")
    return p


def connection_args(url: str, password: str | None = None, tls: bool = False, tls_ca: str | None = None,
                    key_prefix: str | None = None) -> tuple[str, dict[str, Any]]:
    """(URL, client keywords) for the flags; ValueError says what to fix. A ``redis+cluster://``
    URL needs a hash-tag prefix (``{nj}``), as the services do."""
    if tls and url.startswith(("redis://", "redis+cluster://")):
        url = "rediss" + url[len("redis"):]
    kw: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
    if password is not None:
        kw["password"] = password
    if tls_ca:
        if not url.startswith(("rediss://", "rediss+cluster://")):
            raise ValueError("--tls-ca needs TLS: add --tls or use a rediss:// URL")
        kw["ssl_ca_certs"] = tls_ca
    check_redis_url(url, key_prefix)
    return url, kw


def connect(url: str, password: str | None = None, tls: bool = False, tls_ca: str | None = None,
            key_prefix: str | None = None) -> redis.Redis:
    """The services' client for ``url`` (``connect_redis_sync``): ``redis.RedisCluster`` for a
    cluster URL, which reads the topology here, so an unreachable cluster fails here."""
    url, kw = connection_args(url, password, tls, tls_ca, key_prefix)
    return connect_redis_sync(url, **kw)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.redis_url = args.redis_url or env_defaults().redis_url
    out = out or sys.stdout
    console = Console(file=out, width=None if out is sys.stdout else 200, soft_wrap=False)
    try:
        r = connect(args.redis_url, args.redis_password, args.tls, args.tls_ca, args.prefix)
    except ValueError as exc:
        print(f"nightjar queue: {exc}", file=sys.stderr)
        return 2
    except RedisClusterException as exc:  # no seed node answered (the cause says why)
        return _redis_failed(args, exc.__cause__ or exc)
    reader = QueueReader(r, Keys(args.prefix), limit=args.limit)
    try:
        if args.view == "watch":
            return _watch(reader, console, args)
        if args.view == "dlq":
            return _dlq(reader, console, args)
        if args.view == "hold":
            return _hold(reader, console, args)
        _, method, view = VIEWS[args.view]
        doc = getattr(reader, method)(args.window) if args.view in ("stats", "workers") else getattr(reader, method)()
        _emit(console, doc, view, args.json)
        return 0
    except (redis.ConnectionError, RedisClusterException) as exc:
        return _redis_failed(args, exc)
    finally:
        r.close()


def _redis_failed(args: argparse.Namespace, exc: BaseException) -> int:
    if isinstance(exc, redis.AuthenticationError):
        print(f"nightjar queue: Redis refused the credentials ({exc}); check --redis-password or the URL's "
              "password", file=sys.stderr)
    else:
        print(f"nightjar queue: cannot reach Redis at {masked(args.redis_url)} ({exc}); check --redis-url / "
              "NIGHTJAR_REDIS_URL", file=sys.stderr)
    return 1


def _emit(console: Console, doc: dict[str, Any], view, as_json: bool) -> None:
    if as_json:
        console.file.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        console.print(view(doc))


def _dlq(reader: QueueReader, console: Console, args: argparse.Namespace) -> int:
    if args.action is None:
        _emit(console, reader.dlq(), render.dlq_table, args.json)
        return 0
    dry = not args.yes
    try:
        if args.action == "requeue":
            result = requeue(reader.r, reader.keys, args.id, reader.now_ms(), dry_run=dry)
            text = (f"requeued request {result['request_id']} (dead letter {args.id}) as queue entry "
                    f"{result.get('requests_entry_id')}" if not dry else
                    f"would requeue request {result['request_id']} (dead letter {args.id}); add --yes to do it")
            if result["deadline_passed"]:
                text += " — note: its deadline has passed, the scheduler will finish it with 'deadline'"
        else:
            result = purge(reader.r, reader.keys, dry_run=dry)
            text = (f"purged {result['purged']} dead letters" if not dry else
                    f"would purge {result['would_purge']} dead letters; add --yes to do it")
    except MutationError as exc:
        return _refused(console, args, exc)
    if args.json:
        console.file.write(json.dumps(result, sort_keys=True) + "\n")
    else:
        console.print(text)
    return 2 if dry else 0  # a refused mutation is not a success for a script


def _hold(reader: QueueReader, console: Console, args: argparse.Namespace) -> int:
    if (args.spec is None) == (not args.release):
        console.print("[red]nightjar queue hold: give a policy spec or --release, not both[/red]")
        return 2
    try:
        result = hold(reader.r, reader.keys, None if args.release else args.spec, args.seconds, dry_run=not args.yes)
    except MutationError as exc:
        return _refused(console, args, exc)
    if args.json:
        console.file.write(json.dumps(result, sort_keys=True) + "\n")
    elif args.release:
        held = result["held"] or "nothing"
        console.print(f"released the hold on {held}" if args.yes else f"would release the hold on {held}; add --yes to do it")
    else:
        what = f"the planner to publish {args.spec} for {args.seconds:g} s"
        console.print(f"told {what}" if args.yes else f"would tell {what}; add --yes to do it")
    return 0 if args.yes else 2


def _refused(console: Console, args: argparse.Namespace, exc: MutationError) -> int:
    if args.json:
        console.file.write(json.dumps({"error": str(exc)}) + "\n")
    else:
        console.print(f"[red]nightjar queue: {exc}[/red]")
    return 2


def _watch(reader: QueueReader, console: Console, args: argparse.Namespace) -> int:
    if args.interval_s <= 0:
        console.print("[red]nightjar queue watch: --interval-s must be > 0[/red]")
        return 2
    n = 0
    try:
        if args.json:  # one JSON document per refresh, one per line
            while True:
                console.file.write(json.dumps(reader.overview(args.window), sort_keys=True) + "\n")
                console.file.flush()
                n += 1
                if args.iterations and n >= args.iterations:
                    return 0
                time.sleep(args.interval_s)
        with Live(render.dashboard(reader.overview(args.window)), console=console, refresh_per_second=4,
                  screen=False, transient=False) as live:
            n = 1
            while not (args.iterations and n >= args.iterations):
                time.sleep(args.interval_s)
                live.update(render.dashboard(reader.overview(args.window)))
                n += 1
    except KeyboardInterrupt:
        pass
    return 0
