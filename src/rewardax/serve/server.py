"""Runs the app on uvicorn: loopback by default, graceful drain on SIGTERM, exit status 0."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import uvicorn


def run_server(
    app: Any,
    *,
    host: str,
    port: int,
    drain_timeout_s: float = 30.0,
    log: Callable[[str], None] | None = None,
) -> None:
    """Serves `app` until SIGTERM/SIGINT, then stops accepting, answers the requests in flight
    (for up to `drain_timeout_s`) and returns."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=drain_timeout_s,
    )
    server = uvicorn.Server(config)
    # uvicorn handles the signal (drain, then return), then raises it again with the handler it
    # found installed: this one, so the process returns normally (exit 0) instead of dying by it.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if log is not None:
            log(f"listening on http://{host}:{port}")
        server.run()
    except SystemExit:  # uvicorn's answer to a port it cannot bind (after logging why)
        server.started = False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        from rewardax.errors import ConfigError

        raise ConfigError(f"could not serve on {host}:{port} (address in use, or not allowed)")
