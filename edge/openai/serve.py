"""Runs the OpenAI endpoint (``edge.openai.app.create_app``) under uvicorn on a socket bound here.

Binding first lets ``--port 0`` pick a free port and the ready line name it: tests and scripts
read ``serving the OpenAI API on http://HOST:PORT/v1`` from stdout.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from dataclasses import replace

from specsplit.edge.openai.app import ServeConfig, create_app

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(host: str, api_key: str | None) -> None:
    """An endpoint others can reach spends the user's gateway token for them: not without an
    API key."""
    if not _loopback(host) and not api_key:
        raise ValueError(
            f"serving on {host!r}, not a loopback address, needs an API key (--api-key or "
            "$SPECSPLIT_API_KEY): without one anyone who reaches it spends your gateway token"
        )


def run_server(cfg: ServeConfig, host: str, port: int, verbose: bool = False) -> int:
    import uvicorn

    check_exposure(host, cfg.api_key)  # before anything is loaded
    cfg = replace(cfg, bound_host=cfg.bound_host or host)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    app = create_app(cfg)  # loads the tokenizer: a bad --draft fails before the port is taken
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    # uvicorn accepts once its startup is done; connections made before then wait in the backlog.
    print(f"specsplit-edge: serving the OpenAI API on http://{shown}:{bound_port}/v1", flush=True)
    config = uvicorn.Config(
        app,
        loop="asyncio",  # grpc.aio runs on asyncio's own loop
        log_level="debug" if verbose else "info",
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
