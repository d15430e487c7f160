"""deploy/: the kustomize tree renders offline and agrees with the code (ports, flags, probes);
the Grafana dashboard and the HPA only name metrics the gateway exports; the Dockerfile installs
what pyproject says the cloud needs. Nothing here can build an image or reach a cluster."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from specsplit.cloud.cli import _parser
from specsplit.cloud.gateway.admission import Admission, KVShape
from specsplit.cloud.gateway.metrics import GatewayMetrics
from specsplit.cloud.gateway.retry_gate import RetryGate
from specsplit.cloud.supervision.probe import _parser as probe_parser
from specsplit.cloud.supervision.triton import TRITON_KEEPALIVE_FLAGS, BundledTriton, TritonError

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    objects = [o for o in yaml.safe_load_all(out) if o]
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects, deployment: str) -> dict:
    [c] = objects["Deployment", deployment]["spec"]["template"]["spec"]["containers"]
    return c


def port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def service_port(objects, service: str, name: str) -> dict:
    return next(p for p in objects["Service", service]["spec"]["ports"] if p["name"] == name)


def test_kinds(rendered):
    kinds = sorted(kind for kind, _ in rendered)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment"] + [
        "NetworkPolicy",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "Service",
        "Service",
        "Service",
    ]
    for (kind, name), obj in rendered.items():
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specsplit", (kind, name)


def test_gateway_flags_parse_and_match_the_code_defaults(rendered):
    gw = container(rendered, "specsplit-gateway")
    assert gw["command"][0] == "specsplit-cloud"
    args = _parser().parse_args(gw["command"][1:])  # a misspelt flag fails here
    default = _parser().parse_args(["serve"])
    assert args.port == default.port == 50051 == port(gw, "grpc")
    assert args.metrics_port == port(gw, "metrics")
    svc = rendered["Service", "specsplit-gateway"]
    assert service_port(rendered, "specsplit-gateway", "grpc")["port"] == args.port
    assert service_port(rendered, "specsplit-gateway", "metrics")["port"] == args.metrics_port
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    assert args.host == "0.0.0.0"
    # --triton-url names the Triton Service at its gRPC port (comma-separated when several).
    host, _, tport = args.triton_url.partition(":")
    assert ("Service", host) in rendered
    assert service_port(rendered, host, "grpc")["port"] == int(tport)


PROBE = ["python3", "-m", "specsplit.cloud.supervision.probe"]


def probe_args(c: dict, probe: str) -> argparse.Namespace:
    """The probe module's parsed arguments (a misspelt flag fails here)."""
    command = c[probe]["exec"]["command"]
    assert command[:3] == PROBE, command
    return probe_parser().parse_args(command[3:])


def test_gateway_probes_ask_its_health_over_tls(rendered):
    """The kubelet's native gRPC probe speaks plaintext, which a TLS gateway refuses."""
    gw = container(rendered, "specsplit-gateway")
    serve = _parser().parse_args(gw["command"][1:])
    for probe in ("readinessProbe", "livenessProbe"):
        args = probe_args(gw, probe)
        assert args.command == "gateway"
        assert args.address == f"127.0.0.1:{port(gw, 'grpc')}"
        assert secret_of(rendered, "specsplit-gateway", args.tls_ca) == (
            secret_of(rendered, "specsplit-gateway", serve.tls_cert)
        )


def test_triton_liveness_runs_an_inference(rendered):
    """Health stays SERVING when the Python backend stub dies; an inference does not."""
    c = container(rendered, "specsplit-triton")
    args = probe_args(c, "livenessProbe")
    assert args.command == "triton" and args.url == f"127.0.0.1:{port(c, 'grpc')}"
    assert c["livenessProbe"]["timeoutSeconds"] > args.timeout
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == port(c, "grpc"), probe


TRITON_KEEPALIVE = [f.removeprefix("--").split("=")[0] for f in TRITON_KEEPALIVE_FLAGS]


def test_triton_flags_match_its_service_and_the_bundled_binary(rendered):
    c = container(rendered, "specsplit-triton")
    assert c["command"][0] == "tritonserver"
    flags = dict(a.removeprefix("--").split("=", 1) for a in c["command"][1:])
    assert int(flags["grpc-port"]) == port(c, "grpc")
    assert int(flags["metrics-port"]) == port(c, "metrics")
    assert service_port(rendered, "specsplit-triton", "grpc")["port"] == port(c, "grpc")
    assert flags["load-model"] == "target"
    # The gateway's pings are welcome, as under `serve`.
    assert [f"--{k}={flags[k]}" for k in TRITON_KEEPALIVE] == list(TRITON_KEEPALIVE_FLAGS)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in c["env"]}
    gw_args = _parser().parse_args(container(rendered, "specsplit-gateway")["command"][1:])
    assert env["SPECSPLIT_TARGET_DIR"] == gw_args.target  # both read the same model directory
    try:
        bundled = BundledTriton.find()
    except TritonError:
        return  # no tritonserver here: the flags' spelling goes unchecked
    help_text = subprocess.run(
        [str(bundled.binary), "--help"],
        capture_output=True,
        text=True,
        env=bundled.environment(),
        timeout=60,
    )
    for flag in flags:
        assert f"--{flag} " in help_text.stdout + help_text.stderr, flag


def test_envoy_routes_to_the_gateways(rendered):
    [(_, cm_name)] = [k for k in rendered if k[0] == "ConfigMap"]
    volumes = rendered["Deployment", "specsplit-envoy"]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["configMap"]["name"] == cm_name  # kustomize's hashed name, rewritten
    config = yaml.safe_load(rendered["ConfigMap", cm_name]["data"]["envoy.yaml"])
    assert config == yaml.safe_load((DEPLOY / "k8s" / "envoy.yaml").read_text())
    [listener] = config["static_resources"]["listeners"]
    [cluster] = config["static_resources"]["clusters"]
    [lb] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = lb["endpoint"]["address"]["socket_address"]
    assert ("Service", address["address"]) in rendered
    assert rendered["Service", address["address"]]["spec"]["clusterIP"] == "None"  # per-pod
    assert address["port_value"] == service_port(rendered, "specsplit-gateway", "grpc")["port"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    [route] = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s", "a route timeout would cut long generations"
    envoy = container(rendered, "specsplit-envoy")
    assert listener["address"]["socket_address"]["port_value"] == port(envoy, "grpc")
    assert service_port(rendered, "specsplit", "grpc")["targetPort"] == "grpc"


def labels_of(objects, deployment: str) -> dict[str, str]:
    return objects["Deployment", deployment]["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # the only form these policies use
    return selector["matchLabels"].items() <= labels.items()


def admitted(objects, deployment: str, port_number: int) -> list[dict | None]:
    """Who the NetworkPolicies let reach ``port_number`` of ``deployment``'s pods: a list of
    peers (podSelector dicts; None: anyone). No policy selecting the pods: anyone."""
    labels = labels_of(objects, deployment)
    policies = [
        p
        for (kind, _), p in objects.items()
        if kind == "NetworkPolicy" and selects(p["spec"]["podSelector"], labels)
    ]
    if not policies:
        return [None]
    peers = []
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port_number not in ports:
                continue
            peers += rule.get("from") or [None]
    return peers


def test_only_the_gateways_reach_triton_and_only_envoy_the_gateways(rendered):
    """Triton has no auth: any pod reaching its gRPC port could skip tokens, quotas and budget."""
    triton = container(rendered, "specsplit-triton")
    gateway = container(rendered, "specsplit-gateway")
    [peer] = admitted(rendered, "specsplit-triton", port(triton, "grpc"))
    assert peer is not None and set(peer) == {"podSelector"}, peer  # no namespace, no ipBlock
    assert selects(peer["podSelector"], labels_of(rendered, "specsplit-gateway"))
    for other in ("specsplit-envoy", "specsplit-triton"):
        assert not selects(peer["podSelector"], labels_of(rendered, other)), other
    [peer] = admitted(rendered, "specsplit-gateway", port(gateway, "grpc"))
    assert peer is not None and set(peer) == {"podSelector"}, peer
    assert selects(peer["podSelector"], labels_of(rendered, "specsplit-envoy"))
    envoy = container(rendered, "specsplit-envoy")
    assert admitted(rendered, "specsplit-envoy", port(envoy, "grpc")) == [None]  # the public one


def secret_of(objects, deployment: str, path) -> str:
    """The Secret a container of ``deployment`` reads ``path`` from (AssertionError if none)."""
    spec = objects["Deployment", deployment]["spec"]["template"]["spec"]
    [c] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in c["volumeMounts"]:
        if str(path).startswith(mount["mountPath"].rstrip("/") + "/"):
            secret = volumes[mount["name"]].get("secret")
            assert secret is not None, f"{path} is not from a Secret"
            return secret["secretName"]
    raise AssertionError(f"{path} is in no volume of {deployment}")


def test_gateway_requires_tokens_and_tls_from_secrets(rendered):
    gw = container(rendered, "specsplit-gateway")
    args = _parser().parse_args(gw["command"][1:])
    assert args.auth_tokens is not None and args.tls_cert is not None and args.tls_key is not None
    assert secret_of(rendered, "specsplit-gateway", args.auth_tokens) == "specsplit-gateway-tokens"
    assert secret_of(rendered, "specsplit-gateway", args.tls_cert) == "specsplit-gateway-tls"
    assert secret_of(rendered, "specsplit-gateway", args.tls_key) == "specsplit-gateway-tls"
    assert not args.insecure
    # Secrets hold credentials: none is rendered with placeholder values to be applied.
    assert not [name for kind, name in rendered if kind == "Secret"]


def test_the_gateways_share_the_kv_capacity_the_target_reports(rendered, tmp_path):
    """Without --kv-budget-mib each gateway admitted half of its own host's RAM, however many
    gateways shared one Triton and whatever memory its GPU has; then the manifests divided the
    GPU's KV capacity among the gateways by hand. Now the gateways (--triton-url) admit against
    the capacity the target reports, and each client's quota is a share of it."""
    from specsplit.cloud.cli import _admission
    from specsplit.shared.tiny import make_tiny_qwen2

    gw = container(rendered, "specsplit-gateway")
    args = _parser().parse_args(gw["command"][1:])
    assert args.triton_url and args.kv_budget_mib is None and args.kv_per_client_mib is None
    args.target = str(make_tiny_qwen2(tmp_path / "tiny", seed=0))
    admission = _admission(args, Path(args.target))
    assert admission.budget_bytes is None and admission.limit_bytes is None
    admission.observe_capacity("specsplit-triton:8001", 8 * 2**30, 6 * 2**30)
    assert admission.limit_bytes == 2 * 2**30  # what other gateways leave
    assert admission.client_kv_quota == 2 * 2**30  # a quarter of the capacity


def test_no_quota_is_switched_off(rendered):
    """--sessions-per-client=0 (--sessions-per-token=0 before its rename) let one client hold
    every place of every gateway."""
    gw = container(rendered, "specsplit-gateway")
    quota_flags = ("--sessions-per-token", "--sessions-per-client")
    assert not any(a.startswith(quota_flags) for a in gw["command"])
    args = _parser().parse_args(gw["command"][1:])
    assert args.sessions_per_client is None  # the default: a quarter of --max-sessions


def test_envoy_speaks_tls_on_both_hops(rendered):
    """Edges send their token to Envoy, and Envoy passes it on to a gateway: both over TLS."""
    [(_, cm_name)] = [k for k in rendered if k[0] == "ConfigMap"]
    config = yaml.safe_load(rendered["ConfigMap", cm_name]["data"]["envoy.yaml"])
    [listener] = config["static_resources"]["listeners"]
    [chain] = listener["filter_chains"]
    downstream = chain["transport_socket"]["typed_config"]
    assert downstream["@type"].endswith("DownstreamTlsContext")
    [cert] = downstream["common_tls_context"]["tls_certificates"]
    for key in ("certificate_chain", "private_key"):
        assert secret_of(rendered, "specsplit-envoy", cert[key]["filename"]) == "specsplit-tls"
    [cluster] = config["static_resources"]["clusters"]
    upstream = cluster["transport_socket"]["typed_config"]
    assert upstream["@type"].endswith("UpstreamTlsContext")
    ca = upstream["common_tls_context"]["validation_context"]["trusted_ca"]["filename"]
    assert secret_of(rendered, "specsplit-envoy", ca) == "specsplit-gateway-tls"
    [gateway_ca] = [
        v
        for v in rendered["Deployment", "specsplit-envoy"]["spec"]["template"]["spec"]["volumes"]
        if v.get("secret", {}).get("secretName") == "specsplit-gateway-tls"
    ]
    assert [i["key"] for i in gateway_ca["secret"]["items"]] == ["ca.crt"]  # not the key


def exported_names() -> set[str]:
    """Every family the gateway's registry holds, as the service builds it: with its
    admission's and retry gate's (one replica reported, so that its per-replica ones show)."""
    names = set()
    metrics = GatewayMetrics(SimpleNamespace(replicas=[], up=0))
    admission = Admission(KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4))
    admission.observe_capacity("triton:8001", 2**30, 0)
    metrics.watch_admission(admission)
    metrics.watch_gate(RetryGate())
    for family in metrics.registry.collect():
        names |= {family.name + s for s in ("", "_total", "_bucket", "_sum", "_count")}
    return names


def test_dashboard_and_hpa_name_only_exported_metrics():
    names = exported_names()
    dashboard = json.loads((DEPLOY / "grafana" / "specsplit-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"specsplit_\w+", e)}
    assert len(used) >= 15
    assert used <= names, used - names
    hpa = yaml.safe_load((DEPLOY / "k8s" / "hpa.yaml").read_text())
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specsplit-gateway"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in names


def test_dockerfile_installs_the_cloud_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["cloud"]
    wanted = [d for d in wanted if not d.startswith("nvidia-pytriton")]  # the image has Triton
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    installed = set(re.findall(r'"([^"]+)"', dockerfile)) | set(
        re.findall(r"\\\n\s+.*?\b(torch)\b", dockerfile)
    )
    assert set(wanted) <= installed, set(wanted) - installed
