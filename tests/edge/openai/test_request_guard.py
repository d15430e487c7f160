"""`specsplit-edge serve`'s request guard (edge.openai.request_guard), on the real server: a body
over the limit is a 413 before it is read whole; a generation request beyond the slots and the
queue for them is a 429 with Retry-After at once, while the requests already taken finish."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from urllib.parse import urlsplit

import pytest

from specsplit.cloud.gateway.service import start_gateway
from tests.cloud.gateway.test_slow_readers import LONG
from tests.edge.openai.test_openai import EdgeServe, draft_dir  # noqa: F401 (a fixture)
from tests.fakes import MODEL, NOWHERE, FakeTriton

pytestmark = pytest.mark.slow
LIMIT = 64 * 1024


def _post(url: str, body: dict | bytes, timeout: float = 30) -> tuple[int, Message, dict]:
    """(status, headers, JSON body) of a POST to /v1/completions."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/completions", data, method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def small_edge(draft_dir, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """An edge with a 64 KiB body limit; its cloud is nowhere (nothing here reaches it)."""
    log = tmp_path_factory.mktemp("limits") / "serve.log"
    server = EdgeServe(
        "--server", f"127.0.0.1:{_free_port()}", "--draft", str(draft_dir), "--retry-window",
        "0", "--max-body-bytes", str(LIMIT), log_path=log,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_a_body_over_the_limit_is_a_413(small_edge):
    big = {"model": "x", "prompt": "a" * (2 * LIMIT), "max_tokens": 4}
    status, _, body = _post(small_edge.url, big)
    assert status == 413 and body["error"]["param"] == "body"
    assert f"over {LIMIT} bytes" in body["error"]["message"]


def test_a_chunked_body_over_the_limit_is_a_413(small_edge):
    """No Content-Length to check up front: refused once the limit is passed."""
    parts = urlsplit(small_edge.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    chunks = (b'{"model": "x", "prompt": "' + b"a" * 8192 for _ in range(2 * LIMIT // 8192))
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=chunks,
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
        response = conn.getresponse()
        assert response.status == 413
        assert "over" in json.loads(response.read())["error"]["message"]
    finally:
        conn.close()


@contextlib.contextmanager
def held_gateway(model=MODEL) -> Iterator[tuple[int, threading.Event, list]]:
    """A gateway (fake target, own thread and loop) whose steps wait for the event; yields
    (port, the event, the steps begun)."""
    release, begun, ready = threading.Event(), [], threading.Event()
    stop = threading.Event()
    port: list[int] = []

    class Held(FakeTriton):
        async def step(self, *args, **kw):
            begun.append(1)
            while not release.is_set():
                await asyncio.sleep(0.01)
            return await super().step(*args, **kw)

    async def serve() -> None:
        server, bound, service = await start_gateway(NOWHERE, model, sequence_factory=Held)
        port.append(bound)
        ready.set()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.05)
        finally:
            await server.stop(grace=None)
            await service.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the gateway did not start"
        yield port[0], release, begun
    finally:
        release.set()
        stop.set()
        thread.join(30)


def test_requests_beyond_the_slots_and_the_queue_are_a_429_at_once(draft_dir, tmp_path):  # noqa: F811
    with held_gateway() as (port, release, begun):
        server = EdgeServe(
            "--server", f"127.0.0.1:{port}", "--draft", str(draft_dir), "--route", "cloud-only",
            "--concurrency", "1", "--max-waiting", "1", "--retry-window", "0",
            log_path=tmp_path / "serve.log",
        )  # fmt: skip
        try:
            request = {"model": "x", "prompt": "hello", "max_tokens": 4}
            answers: list = [None, None]

            def ask(i: int) -> None:
                answers[i] = _post(server.url, request)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            threads[0].start()  # takes the one slot; its first step is held
            deadline = time.monotonic() + 30
            while not begun and time.monotonic() < deadline:
                time.sleep(0.02)
            threads[1].start()  # waits for the slot
            time.sleep(0.5)
            t0 = time.monotonic()
            status, headers, body = _post(server.url, request, timeout=5)
            refused_in = time.monotonic() - t0
            release.set()
            for t in threads:
                t.join(30)
        finally:
            server.stop()
    assert status == 429 and headers.get("Retry-After") == "1"
    assert body["error"]["code"] == "too_many_requests" and refused_in < 1.0
    assert [a[0] for a in answers] == [200, 200]


def test_a_stream_its_client_does_not_read_gives_its_slot_back(draft_dir, tmp_path):  # noqa: F811
    """A streamed completion whose client reads nothing: once the sockets' buffers are full the
    response waits on the client; after --send-timeout it ends and its slot serves the next
    request (else one such client per slot shuts the endpoint)."""
    with held_gateway(LONG) as (port, release, _):
        release.set()  # an endless cloud-only generation
        server = EdgeServe(
            "--server", f"127.0.0.1:{port}", "--draft", str(draft_dir), "--route", "cloud-only",
            "--concurrency", "1", "--send-timeout", "1", "--retry-window", "0",
            log_path=tmp_path / "serve.log",
        )  # fmt: skip
        parts = urlsplit(server.url)
        stuck = socket.socket()
        try:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect((parts.hostname, parts.port))
            body = json.dumps(
                {"model": "x", "prompt": "hello", "max_tokens": 1 << 30, "stream": True}
            ).encode()
            stuck.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )  # and never a read
            time.sleep(0.5)
            t0 = time.monotonic()
            request = {"model": "x", "prompt": "hi", "max_tokens": 4}
            status, _, answer = _post(server.url, request, timeout=40)
            waited = time.monotonic() - t0
        finally:
            stuck.close()
            server.stop()
    print(f"the next request was served after {waited:.1f} s")
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    # The kernel's send buffer grows to 4 MiB before the stuck stream waits: seconds to fill.
    assert waited < 25


def test_a_dns_rebinding_request_gets_a_403(small_edge):
    """A page whose name was rebound to 127.0.0.1 sends its own name as Host: refused, while the
    same request for 127.0.0.1 is answered (edge.openai.hosts)."""
    for host, status in (("evil.example", 403), (urlsplit(small_edge.url).netloc, 200)):
        request = urllib.request.Request(f"{small_edge.url}/models", headers={"Host": host})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                got, body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            got, body = e.code, json.loads(e.read())
        assert got == status, body
        if status == 403:
            assert body["error"]["code"] == "host_not_allowed"
