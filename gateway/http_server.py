"""uvicorn inside the gateway's event loop (uvloop), serving the OpenAI HTTP app on its own port."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _Server(uvicorn.Server):
    # The gateway owns SIGTERM (drain first, then stop); uvicorn must not take the signal over.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HTTPServer:
    def __init__(self, app, host: str, port: int) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))  # bound here so that port 0 yields a known port
        except OSError as exc:
            self._sock.close()
            raise RuntimeError(f"could not listen for HTTP on {host}:{port} ({exc}); pick another --http-port") from None
        self.port = self._sock.getsockname()[1]
        # h11 is uvicorn's pure-Python parser; httptools, pinned beside it, is the fast one.
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", loop="none",
                                http="httptools", timeout_graceful_shutdown=2, server_header=False)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="gateway-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait([self._task], timeout=5.0)
        self._task = None
