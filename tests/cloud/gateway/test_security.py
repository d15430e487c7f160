"""TLS, mTLS and bearer tokens on a real `specsplit-cloud serve` (gateway in front of the shared
test Triton), with certificates made at test time."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.channel import channel_credentials
from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
from specsplit.shared.protocol import SERVICE_NAME
from tests.certs import Certs, make_certs

pytestmark = pytest.mark.slow
TOKEN = "s3cret-edge-token"
PROMPT = [1, 2, 3, 4, 5]
EDGE = str(Path(sys.executable).parent / "specsplit-edge")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secured(cloud, tiny, certs, tmp_path_factory):
    """A gateway with TLS and tokens, in front of the shared test Triton."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    tokens.write_text(f"# edge fleet\n\nother-token\n{TOKEN}\n")
    args = ["--triton-url", cloud.triton_url, "--target", str(tiny.target)]
    args += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    args += ["--auth-tokens", str(tokens)]
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("secured")) as c:
        yield c


@pytest.fixture(scope="module")
def mutual(cloud, tiny, certs, tmp_path_factory):
    """A gateway that requires client certificates signed by the test CA (mTLS)."""
    args = ["--triton-url", cloud.triton_url, "--target", str(tiny.target)]
    args += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    args += ["--tls-client-ca", str(certs.ca)]
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("mutual")) as c:
        yield c


def cloud_only(address: str, **client_kw) -> list[int]:
    async def run() -> list[int]:
        async with SplitClient(address, **client_kw) as client:
            gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=6), route="cloud-only")
            return await gen.collect()

    return asyncio.run(run())


def refused(address: str, **client_kw) -> SpecsplitError:
    with pytest.raises(SpecsplitError) as e:
        cloud_only(address, **client_kw)
    return e.value


@pytest.fixture(scope="module")
def plain_output(cloud) -> list[int]:
    return cloud_only(cloud.address)


def test_tls_with_token_generates(secured, certs, plain_output):
    assert cloud_only(secured.address, tls_ca=certs.ca, token=TOKEN) == plain_output


@pytest.mark.parametrize("tls", [False, True])
def test_a_client_with_the_wrong_tls_settings_is_refused_at_once(secured, tls):
    """Plaintext to a TLS gateway, or TLS without our CA: a configuration error, reported
    with a hint, not retried for the whole retry window as an outage would be."""
    e = refused(secured.address, token=TOKEN, tls=tls)
    assert e.code == grpc.StatusCode.UNAVAILABLE
    assert "TLS mismatch" in str(e) and "not retried" in str(e), e


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_missing_or_wrong_token_is_unauthenticated(secured, certs, token):
    e = refused(secured.address, tls_ca=certs.ca, token=token)
    assert e.code == grpc.StatusCode.UNAUTHENTICATED, e


def test_health_needs_no_token(secured, certs):
    creds = channel_credentials(certs.ca)
    with grpc.secure_channel(secured.address, creds) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_mtls_refuses_a_client_without_certificate(mutual, certs, plain_output):
    e = refused(mutual.address, tls_ca=certs.ca)
    assert e.code == grpc.StatusCode.UNAVAILABLE and "--tls-cert" in str(e), e
    mtls = dict(tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key)
    assert cloud_only(mutual.address, **mtls) == plain_output


def test_edge_cli_with_tls_and_token_from_env(secured, certs, plain_output):
    args = ["generate", "--server", secured.address, "--tls-ca", str(certs.ca)]
    args += ["--route", "cloud-only", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6"]
    env = {**os.environ, "SPECSPLIT_TOKEN": TOKEN}
    ok = subprocess.run([EDGE, *args], capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert [int(t) for t in ok.stdout.split()] == plain_output
    env.pop("SPECSPLIT_TOKEN")
    bad = subprocess.run([EDGE, *args], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "UNAUTHENTICATED" in bad.stderr


def test_the_gateway_liveness_probe_speaks_tls(secured, certs, capfd):
    """deploy/k8s probes a TLS gateway with the probe module: the kubelet's gRPC probe speaks
    plaintext only, which a TLS gateway refuses (so would the probe without --tls-ca)."""
    from specsplit.cloud.supervision.probe import main as probe

    tls = ["--tls-ca", str(certs.ca)]
    assert probe(["gateway", "--address", secured.address, *tls]) == 0
    # The manifests' form: 127.0.0.1 probed, the certificate's name given apart.
    assert probe(["gateway", "--address", secured.address, *tls, "--server-name", "localhost"]) == 0
    capfd.readouterr()
    assert probe(["gateway", "--address", secured.address, "--timeout", "2"]) == 1
    assert "health check" in capfd.readouterr().err
