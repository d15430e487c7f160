"""`specsplit-edge serve` on a laptop: the Host allow-list against DNS rebinding
(edge.openai.hosts), an API key required off loopback, tokenising off the event loop, request
paths logged with repr. The app is called in process over plain ASGI (its cloud is nowhere: no
request here reaches it); tests/edge/openai/test_request_guard.py sends a rebinding request to
the real server process."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from urllib.parse import unquote

import pytest

from specsplit.edge.openai.app import ServeConfig, create_app
from specsplit.edge.openai.hosts import HostPolicy, host_name
from specsplit.edge.openai.serve import check_exposure
from tests.edge.openai.test_openai import write_tokenizer


@pytest.fixture
def draft_dir(tmp_path) -> Path:
    write_tokenizer(tmp_path)  # only the tokenizer: cloud-only serving loads no draft
    return tmp_path


def config(draft_dir: Path, **kw) -> ServeConfig:
    kw.setdefault("route", "cloud-only")
    return ServeConfig(server="127.0.0.1:1", draft_dir=draft_dir, model_name="m", **kw)


def call(app, method: str, target: str, host: str | None, body: bytes = b"", headers=()):
    """One request through the ASGI app: (status, JSON body)."""
    path, _, query = target.partition("?")
    raw = [(b"content-length", str(len(body)).encode()), *headers]
    if host is not None:
        raw.append((b"host", host.encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": unquote(path), "raw_path": path.encode(),
        "query_string": query.encode(), "root_path": "", "headers": raw,
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    out: dict = {"body": b""}
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays; nothing more arrives

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out["status"], json.loads(out["body"] or b"null")


@pytest.mark.parametrize(
    "header, name",
    [("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"), ("LocalHost.", "localhost"),
     ("edge.lan", "edge.lan"), ("::1", "::1")],
)  # fmt: skip
def test_host_names_are_read_without_port_or_brackets(header, name):
    assert host_name(header) == name


def test_a_dns_rebinding_request_is_refused(draft_dir):
    """The page's own name in Host, sent to 127.0.0.1: 403, before the API key or a route."""
    app = create_app(config(draft_dir, api_key="k"))
    status, body = call(app, "GET", "/v1/models", "evil.example")
    assert status == 403 and body["error"]["code"] == "host_not_allowed"
    assert "evil.example" in body["error"]["message"]
    status, _ = call(app, "GET", "/health", "evil.example:8000")
    assert status == 403
    auth = ((b"authorization", b"Bearer k"),)
    for good in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "192.168.1.7", None):
        status, body = call(app, "GET", "/v1/models", good, headers=auth)
        assert status == 200, (good, body)


def test_allowed_hosts_and_the_bound_name_are_answered(draft_dir):
    app = create_app(config(draft_dir, allowed_hosts=("edge.lan",), bound_host="box.internal"))
    assert call(app, "GET", "/v1/models", "edge.lan:8000")[0] == 200
    assert call(app, "GET", "/v1/models", "box.internal")[0] == 200
    assert call(app, "GET", "/v1/models", "evil.example")[0] == 403
    assert HostPolicy(["*"]).allows("evil.example")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "edge.lan"])
def test_an_address_others_reach_needs_an_api_key(host):
    with pytest.raises(ValueError, match="needs an API key"):
        check_exposure(host, None)
    check_exposure(host, "k")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_serves_without_a_key(host):
    check_exposure(host, None)


def test_the_cli_refuses_a_public_bind_without_a_key(draft_dir, capsys, monkeypatch):
    from specsplit.edge import cli

    monkeypatch.delenv("SPECSPLIT_API_KEY", raising=False)
    argv = ["serve", "--host", "0.0.0.0", "--port", "0", "--draft", str(draft_dir)]
    assert cli.main([*argv, "--route", "cloud-only"]) == 2
    assert "needs an API key" in capsys.readouterr().err


def test_prompts_are_tokenised_off_the_event_loop(draft_dir, monkeypatch):
    from specsplit.edge.text import TextCodec

    threads = []
    encode = TextCodec.encode

    def recording(self, text):
        threads.append(threading.current_thread())
        return encode(self, text)

    monkeypatch.setattr(TextCodec, "encode", recording)
    app = create_app(config(draft_dir))
    body = json.dumps({"model": "m", "prompt": ""}).encode()  # empty: refused after tokenising
    headers = ((b"content-type", b"application/json"),)
    status, answer = call(app, "POST", "/v1/completions", "127.0.0.1", body, headers)
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert threads and threading.main_thread() not in threads  # the loop runs in this thread


def test_request_paths_are_logged_with_repr(draft_dir, caplog):
    """A percent-encoded newline in the path must not start a forged log line."""
    app = create_app(config(draft_dir, max_body_bytes=16))
    forged = "/v1/x%0A2026-01-01 00:00:00 INFO admin logged in"
    with caplog.at_level(logging.INFO):
        assert call(app, "POST", forged, "127.0.0.1", b"x" * 64)[0] == 413
        assert call(app, "GET", forged, "evil.example")[0] == 403
    lines = [r.getMessage() for r in caplog.records if "admin logged in" in r.getMessage()]
    assert len(lines) == 2 and not any("\n" in line for line in lines)
