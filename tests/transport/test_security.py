"""Bearer tokens and TLS / mutual TLS on the public port and on the worker links, with real processes."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from splitspec.v1 import common_pb2, target_pb2_grpc
from tests.client import generate
from tests.tools import free_port

pytestmark = pytest.mark.slow


def _free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def _issue(name: str, issuer_key, issuer_name, *, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate and a client certificate, written as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("splitspec test CA", None, None, ca=True)
    files = {}
    for name in ("server", "client"):
        key, cert = _issue(name, ca_key, ca_cert.subject)
        (root / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[name] = (str(root / f"{name}.pem"), str(root / f"{name}.key"))
    (root / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files["ca"] = str(root / "ca.pem")
    return files


def test_tokens_and_mutual_tls_end_to_end(services, tiny_pair, pki):
    server_cert, server_key = pki["server"]
    client_cert, client_key = pki["client"]
    ca = pki["ca"]
    read = lambda p: open(p, "rb").read()  # noqa: E731
    mtls = grpc.ssl_channel_credentials(read(ca), read(client_key), read(client_cert))
    worker_tls = ["--auth-token", "worker-secret", "--tls-cert", server_cert, "--tls-key", server_key, "--tls-client-ca", ca]
    target = services.start("target", "target", "--model", str(tiny_pair.target), *worker_tls, address=_free_address(), credentials=mtls)
    draft = services.start(
        "draft", "draft", "--model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target), *worker_tls,
        address=_free_address(), credentials=mtls,
    )
    tls = grpc.ssl_channel_credentials(read(ca))
    gateway = services.start(
        "gateway", "gateway", "--target", target, "--draft", draft,
        "--worker-token", "worker-secret", "--worker-ca", ca, "--worker-cert", client_cert, "--worker-key", client_key,
        "--auth-token", "client-secret", "--tls-cert", server_cert, "--tls-key", server_key,
        address=_free_address(), credentials=tls,
    )
    request = dict(text="hello", max_tokens=8)
    with grpc.secure_channel(gateway, tls) as ch:
        ok = generate(gateway, channel=ch, metadata=(("authorization", "Bearer client-secret"),), **request)
        assert len(ok.tokens) == 8 and ok.final.usage.draft_fallbacks == 0
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", "client-secret"),)]:
            with pytest.raises(grpc.RpcError) as denied:
                generate(gateway, channel=ch, metadata=metadata, **request)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(gateway) as plain, pytest.raises(grpc.RpcError) as no_tls:
        generate(gateway, channel=plain, metadata=(("authorization", "Bearer client-secret"),), timeout=5, **request)
    assert no_tls.value.code() == grpc.StatusCode.UNAVAILABLE

    # A worker refuses a client without a certificate signed by its CA, and a token-less client.
    with grpc.secure_channel(target, tls) as no_cert, pytest.raises(grpc.RpcError) as refused:
        target_pb2_grpc.TargetWorkerStub(no_cert).Info(common_pb2.InfoRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(target, mtls) as no_token, pytest.raises(grpc.RpcError) as anonymous:
        target_pb2_grpc.TargetWorkerStub(no_token).Info(common_pb2.InfoRequest(), timeout=5)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # The command-line client speaks TLS and sends the token.
    done = subprocess.run(
        [sys.executable, "-m", "splitspec", "generate", "hello", "--address", gateway, "--max-tokens", "8",
         "--ca", ca, "--token", "client-secret", "--timeout", "30"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "8 generated tokens" in done.stderr
