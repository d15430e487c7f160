"""Liveness probes for the pods of deploy/k8s, run by the kubelet as exec probes:

    python -m specsplit.cloud.supervision.probe triton  [--url 127.0.0.1:8001]
    python -m specsplit.cloud.supervision.probe gateway [--address 127.0.0.1:50051] [--tls-ca F]

Exit status 0: alive; 1: not (the reason on stderr, which the kubelet records in the pod's
events).

``triton`` runs a real inference: it starts a one-token sequence on the target and ends it. A
Triton whose Python backend stub died keeps answering ``grpc.health.v1`` and calls the model
ready while failing every request ("Stub process ... is not healthy"; ``TritonServer.stub_lost``
is how `serve` notices it); only a request through the stub tells, and a failing probe has the
kubelet restart the container, as `serve`'s supervisor (``cloud.supervision.supervisor``) restarts
its own tritonservers.

``gateway`` asks the gateway's ``grpc.health.v1`` over TLS: the kubelet's native gRPC probe
speaks plaintext only, and a gateway that serves TLS refuses it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

PROBE_PROMPT = (0,)  # one token: every vocabulary has id 0


class ProbeFailed(RuntimeError):
    pass


async def triton_infers(url: str, timeout_s: float) -> None:
    """Starts a one-token sequence on the target at ``url`` and ends it; raises ProbeFailed
    unless the target answered within ``timeout_s``."""
    import tritonclient.grpc.aio as aioclient

    from specsplit.cloud.gateway.triton_client import TritonSequence
    from specsplit.shared.acceptance import VerificationRule
    from specsplit.shared.sampling import SamplingConfig

    client = aioclient.InferenceServerClient(url)
    sequence = TritonSequence(client)
    try:
        start = sequence.start(PROBE_PROMPT, SamplingConfig(), VerificationRule.GREEDY, seed=0)
        await asyncio.wait_for(start, timeout_s)
    except asyncio.TimeoutError:
        raise ProbeFailed(f"the target at {url} did not answer within {timeout_s:g} s") from None
    except Exception as e:  # TritonUnavailable, TritonRequestError (a dead stub), gRPC errors
        raise ProbeFailed(f"the target at {url} failed a one-token inference: {e}") from e
    finally:
        await sequence.close()  # frees the sequence's KV; never raises
        await client.close()


def gateway_serving(
    address: str, timeout_s: float, tls_ca: Path | None = None, server_name: str | None = None
) -> None:
    """Raises ProbeFailed unless the gateway's ``grpc.health.v1`` says SERVING (TLS when
    ``tls_ca`` is given; ``server_name``: the name its certificate holds, when it is not the
    address probed)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls_ca is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
        channel = grpc.secure_channel(address, creds, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as e:
            raise ProbeFailed(f"health check of {address} failed: {e.code().name}") from e
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        raise ProbeFailed(f"the gateway at {address} is {name}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specsplit.cloud.supervision.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("triton", help="a one-token inference on the target")
    t.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC host:port")
    t.add_argument("--timeout", type=float, default=20.0, help="seconds (default 20)")
    g = sub.add_parser("gateway", help="the gateway's grpc.health.v1, over TLS if --tls-ca")
    g.add_argument("--address", default="127.0.0.1:50051", help="the gateway's host:port")
    g.add_argument("--tls-ca", type=Path, help="PEM CA of the gateway's certificate")
    g.add_argument("--server-name", help="the name in the gateway's certificate")
    g.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.timeout > 0:
        print("probe: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        if args.command == "triton":
            asyncio.run(triton_infers(args.url, args.timeout))
        else:
            gateway_serving(args.address, args.timeout, args.tls_ca, args.server_name)
    except (ProbeFailed, OSError) as e:
        print(f"probe: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
