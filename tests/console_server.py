"""The console on a real loopback HTTP server (uvicorn in a thread), for the API and browser tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from console.auth import ConsoleConfig


@contextmanager
def serve(config: ConsoleConfig) -> Iterator[str]:
    """Serve the console with ``config`` on 127.0.0.1 (a free port); yields its base URL."""
    import uvicorn

    from console.app import create_app

    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=0, access_log=False, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="console-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the console did not start within 10 s")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
