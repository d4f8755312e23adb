"""The HTTP API under the gateway's TLS flags: --tls-cert/--tls-key serve HTTPS, --tls-client-ca
requires a client certificate, and --auth-token a bearer token, as for gRPC."""

from __future__ import annotations

import ssl

import grpc
import openai
import pytest

from tests.http.conftest import httpx
from tests.tools import free_port
from tests.transport.test_security import _free_address, pki  # noqa: F401 - pki is a fixture

pytestmark = pytest.mark.slow


def test_https_with_client_certificates_and_token(services, tiny_pair, pki):  # noqa: F811
    server_cert, server_key = pki["server"]
    client_cert, client_key = pki["client"]
    read = lambda p: open(p, "rb").read()  # noqa: E731
    mtls = grpc.ssl_channel_credentials(read(pki["ca"]), read(client_key), read(client_cert))
    target = services.start("target", "target", "--model", str(tiny_pair.target))
    port = free_port()
    services.start(
        "gateway", "gateway", "--target", target, "--draft", "", "--http-listen", f"127.0.0.1:{port}", "--auth-token", "s3cret",
        "--tls-cert", server_cert, "--tls-key", server_key, "--tls-client-ca", pki["ca"], address=_free_address(), credentials=mtls,
    )
    trusted = ssl.create_default_context(cafile=pki["ca"])
    with_cert = ssl.create_default_context(cafile=pki["ca"])
    with_cert.load_cert_chain(client_cert, client_key)
    url = f"https://127.0.0.1:{port}/v1"

    client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0, http_client=httpx.Client(verify=with_cert))
    reply = client.completions.create(model="target", prompt="x", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, http_client=httpx.Client(verify=with_cert)).models.list()
    with pytest.raises(openai.APIConnectionError):  # no client certificate: the handshake fails
        openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0, http_client=httpx.Client(verify=trusted)).models.list()
    with pytest.raises(openai.APIConnectionError):  # plain HTTP is not served
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0).models.list()
