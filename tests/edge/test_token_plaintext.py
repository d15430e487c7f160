"""The edge never sends its bearer token in plaintext off this host unless --insecure says so
(issue 39, item 1): whoever is on the path could read it and use it. Nothing is sent in these
tests; the refusal comes before a channel opens."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.edge.cli import main
from specsplit.edge.client import SplitClient, is_loopback


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("127.0.0.1:50051", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("ipv4:127.0.0.5:1", True),
        ("unix:/tmp/gw.sock", True),
        ("10.0.0.1:50051", False),
        ("gateway.example.com:443", False),
        ("[2001:db8::1]:50051", False),
        ("dns:///specsplit:50051", False),
        ("localhost.evil.example:50051", False),
    ],
)
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_a_token_in_plaintext_off_this_host_is_refused():
    with pytest.raises(ValueError, match="plaintext.*--insecure"):
        SplitClient("10.0.0.1:50051", token="t0k3n")


@pytest.mark.parametrize(
    "address, kw",
    [
        ("10.0.0.1:50051", dict(token="t0k3n", insecure=True)),
        ("10.0.0.1:50051", dict(token="t0k3n", tls=True)),
        ("10.0.0.1:50051", dict()),  # no token: nothing to leak
        ("127.0.0.1:50051", dict(token="t0k3n")),
    ],
)
def test_tls_insecure_loopback_or_no_token_are_allowed(address, kw):
    async def open_and_close():
        async with SplitClient(address, **kw):
            pass

    asyncio.run(open_and_close())


def test_edge_cli_refuses_and_says_how(capfd):
    argv = ["generate", "--server", "10.0.0.1:50051", "--token", "t0k3n"]
    argv += ["--route", "cloud-only", "--prompt-ids", "1,2,3"]
    assert main(argv) == 2
    assert "--insecure" in capfd.readouterr().err
