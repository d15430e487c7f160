"""The liveness probes of deploy/k8s against real servers (issue 39, item 2): Triton's runs an
inference, so it fails once the Python backend stub is dead, while Triton's own health still
says SERVING (what the kubelet's gRPC probe asked, and why it never restarted such a pod)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.cloud.supervision.probe import main
from specsplit.cloud.supervision.triton import TritonServer, stub_pids

pytestmark = pytest.mark.slow


def health(url: str) -> int:
    with grpc.insecure_channel(url) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return reply.status


def test_triton_probe_fails_once_the_stub_is_dead_though_health_says_serving(tiny, capfd):
    with TritonServer(tiny.target, startup_timeout_s=180) as server:
        assert main(["triton", "--url", server.url]) == 0
        stubs = stub_pids(server.proc.pid)
        assert stubs, "the Python backend stub should run under tritonserver"
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not server.stub_lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.stub_lost
        capfd.readouterr()
        assert main(["triton", "--url", server.url, "--timeout", "20"]) == 1
        assert "failed a one-token inference" in capfd.readouterr().err
        # The kubelet's native gRPC probe asked this, and it stays SERVING: never restarted.
        assert health(server.url) == health_pb2.HealthCheckResponse.SERVING


def test_triton_probe_fails_when_nothing_listens(capfd):
    assert main(["triton", "--url", "127.0.0.1:1", "--timeout", "5"]) == 1
    assert "probe:" in capfd.readouterr().err
