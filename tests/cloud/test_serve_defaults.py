"""`specsplit-cloud serve` is closed by default off this host: no open port without tokens unless
--insecure says so, and metrics on 127.0.0.1 whatever --host (issue 39, item 1). Nothing here
starts Triton: the checks run before it would."""

from __future__ import annotations

import contextlib

import pytest
from prometheus_client import CollectorRegistry

from specsplit.cloud.cli import _parser, _security, _start_metrics, main


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_public_host_without_tokens_refuses_to_start(host, capfd):
    assert main(["serve", "--host", host]) == 1
    err = capfd.readouterr().err
    assert "without --auth-tokens" in err and "--insecure" in err, err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_tokens(host):
    assert _security(_parser().parse_args(["serve", "--host", host])).tokens is None


def test_insecure_or_tokens_open_a_public_host(tmp_path):
    assert _security(_parser().parse_args(["serve", "--host", "0.0.0.0", "--insecure"]))
    tokens = tmp_path / "tokens"
    tokens.write_text("t0k3n\n")
    args = _parser().parse_args(["serve", "--host", "0.0.0.0", "--auth-tokens", str(tokens)])
    assert _security(args).tokens == (b"t0k3n",)


@pytest.mark.parametrize(
    "flags, bound",
    [([], "127.0.0.1"), (["--metrics-host", "0.0.0.0"], "0.0.0.0")],
)
def test_metrics_bind_loopback_unless_told(flags, bound):
    """They name every replica's URL: a public --host does not publish them too."""
    args = _parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--insecure", "--metrics-port", "0", *flags]
    )
    server = _start_metrics(args, CollectorRegistry())
    try:
        assert server.server_address[0] == bound
    finally:
        with contextlib.suppress(Exception):
            server.shutdown()
        server.server_close()


def test_streams_per_connection_default_to_twice_the_places():
    """Streams past the places must reach admission (a retry hint, a reclaimed idle stream);
    and one process's channels to one address share a connection (an edge's OpenAI server, the
    load benchmark). At --max-sessions 1 a cap of 1 left the second stream waiting unseen."""
    from specsplit.cloud.cli import _stream_policy

    args = _parser().parse_args(["serve", "--max-sessions", "8"])
    assert _stream_policy(args).max_streams_per_connection == 16
    flags = ["serve", "--streams-per-connection", "3"]
    assert _stream_policy(_parser().parse_args(flags)).max_streams_per_connection == 3
    with pytest.raises(ValueError, match="streams per connection"):
        _stream_policy(_parser().parse_args(["serve", "--streams-per-connection", "0"]))
