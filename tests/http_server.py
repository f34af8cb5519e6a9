"""uvicorn serving an ASGI app in a thread of the test process, on a free port of 127.0.0.1."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class Server:
    """uvicorn serving ``app`` in a thread, on a free port of 127.0.0.1 (``url``); :meth:`stop` ends it."""

    def __init__(self, app: Any):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
