"""An ASGI app served by uvicorn on a free loopback port in a daemon thread, for the tests that talk HTTP to it."""

from __future__ import annotations

import socket
import threading
import time


class LiveServer:
    """`app` on http://127.0.0.1:PORT (`base`) until `stop`."""

    def __init__(self, app, startup_s: float = 30.0):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_s
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
