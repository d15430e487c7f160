"""A throwaway CA, server and client certificates, made at test time (never committed)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _issue(subject: str, key, issuer: str, issuer_key, *, ca=False, san=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(root: Path) -> Certs:
    root.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("specsplit test CA", ca_key, "specsplit test CA", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _issue("localhost", server_key, "specsplit test CA", ca_key, san=san)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("edge", client_key, "specsplit test CA", ca_key)
    pem = serialization.Encoding.PEM
    (root / "ca.pem").write_bytes(ca.public_bytes(pem))
    (root / "server.pem").write_bytes(server.public_bytes(pem))
    (root / "client.pem").write_bytes(client.public_bytes(pem))
    return Certs(
        ca=root / "ca.pem",
        server_cert=root / "server.pem",
        server_key=_write_key(server_key, root / "server.key"),
        client_cert=root / "client.pem",
        client_key=_write_key(client_key, root / "client.key"),
    )
