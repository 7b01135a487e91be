"""A real Redis Cluster on loopback for the tests: ``redis-server --cluster-enabled yes`` nodes
joined by ``redis-cli --cluster create``, optionally with one replica per primary and AOF.

``LocalCluster`` answers what the tests ask of the cluster itself (which primary owns a key's
slot, which node replicates it) by asking the live nodes, never the client under test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from nightjar_tools.redis_server import free_port, redis_server_binary

NODE_TIMEOUT_MS = 5000  # cluster-node-timeout: how long before a silent node is suspected


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 20.0) -> object:
    """``check()``'s first truthy value, polled every 0.1 s; Redis errors count as "not yet"."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
            if got:
                return got
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class LocalCluster:
    """``masters`` primaries, each with ``replicas`` replicas, in ``root`` (one folder a node).
    ``appendonly``: AOF with ``appendfsync everysec``, as compose runs Redis."""

    def __init__(self, root: Path, masters: int = 3, replicas: int = 0, appendonly: bool = False) -> None:
        self.root, self.masters, self.replicas, self.appendonly = root, masters, replicas, appendonly
        self.procs: dict[int, subprocess.Popen] = {}  # port -> redis-server

    @property
    def ports(self) -> list[int]:
        """Every node, in the order they were started."""
        return list(self.procs)

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def live(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def start(self) -> LocalCluster:
        server = redis_server_binary()
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                port = free_cluster_port()
                d = self.root / f"node{port}"
                d.mkdir(parents=True)
                with open(d / "redis.log", "ab") as log:
                    self.procs[port] = subprocess.Popen(
                        [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                         "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                         "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                         "--dir", str(d), "--loglevel", "warning"],
                        stdout=subprocess.DEVNULL, stderr=log)
            for port in self.ports:
                wait_for(lambda: self.ask_node(port, "PING"), f"node {port}")
            cli = str(Path(server).with_name("redis-cli"))
            out = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                                  "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            for port in self.ports:
                wait_for(lambda: self.ask_node(port, "CLUSTER INFO")["cluster_state"] == "ok", f"cluster state ok on {port}")
            for port in self.ports:  # every replica has its primary's data
                wait_for(lambda: self.role(port)[0] == b"master" or self.role(port)[3] == b"connected",
                         f"the replica {port} in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ asking the nodes

    def ask_node(self, port: int, *command):
        node = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=5)
        try:
            return node.execute_command(*command)
        finally:
            node.close()

    def ask(self, *command):
        """``command`` on the first live node."""
        return self.ask_node(self.live()[0], *command)

    def role(self, port: int) -> list:
        """``ROLE``: [b"master", offset, replicas] or [b"slave", host, port, state, offset]."""
        return self.ask_node(port, "ROLE")

    def slot(self, key: str) -> int:
        return int(self.ask("CLUSTER KEYSLOT", key))

    def owner(self, key: str, port: int | None = None) -> int:
        """The port of the primary that owns ``key``'s slot, as node ``port`` (default: the
        first live one) sees it."""
        slot = self.slot(key)
        for start, end, primary, *_replicas in self.ask_node(port or self.live()[0], "CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise AssertionError(f"no node owns the slot of {key}")

    def replicas_of(self, primary: int) -> list[int]:
        """The live replicas of ``primary`` that are connected to it."""
        roles = {port: self.role(port) for port in self.live()}
        return [port for port, role in roles.items()
                if role[0] == b"slave" and int(role[2]) == primary and role[3] == b"connected"]

    def replica_of(self, primary: int) -> int:
        replicas = self.replicas_of(primary)
        assert replicas, f"no live replica of {primary}"
        return replicas[0]

    def fail_over(self, replica: int, key: str, *, takeover: bool = False, timeout_s: float = 30.0) -> None:
        """``CLUSTER FAILOVER [TAKEOVER]`` on ``replica``, then wait until it is a primary and
        every live node says it owns ``key``'s slot. Without TAKEOVER it is the graceful manual
        failover: the primary stops writes until the replica has all of them, then they swap."""
        self.ask_node(replica, "CLUSTER FAILOVER", *(["TAKEOVER"] if takeover else []))
        self.wait_promoted(replica, key, timeout_s)

    def wait_promoted(self, replica: int, key: str, timeout_s: float = 30.0) -> None:
        """Until ``replica`` is a primary and every live node says it owns ``key``'s slot."""
        wait_for(lambda: self.role(replica)[0] == b"master", f"{replica} promoted", timeout_s)
        wait_for(lambda: all(self.owner(key, p) == replica for p in self.live()),
                 f"every node to see {replica} own the slot", timeout_s)

    def move_slot(self, slot: int, src: int, dst: int) -> None:
        """Reshard one slot the way ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING,
        MIGRATE every key (DUMP/RESTORE: streams keep their consumer groups), then the new owner
        on every primary (replicas learn it from theirs)."""
        src_id, dst_id = self.ask_node(src, "CLUSTER MYID"), self.ask_node(dst, "CLUSTER MYID")
        self.ask_node(dst, "CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        self.ask_node(src, "CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while keys := self.ask_node(src, "CLUSTER GETKEYSINSLOT", slot, 1000):
            self.ask_node(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        others = [p for p in self.live() if p not in (src, dst) and self.role(p)[0] == b"master"]
        for port in [dst, src, *others]:
            self.ask_node(port, "CLUSTER SETSLOT", slot, "NODE", dst_id)

    def kill(self, port: int) -> None:
        """SIGKILL a node: no AOF fsync, no goodbye to the cluster."""
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
