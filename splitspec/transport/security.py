"""TLS, mutual TLS and bearer tokens for servers and for the channels between services.

A server is secured by ``--auth-token`` (clients must send ``authorization: Bearer <token>``),
``--tls-cert``/``--tls-key`` (serve TLS) and ``--tls-client-ca`` (also require client
certificates signed by that CA: mutual TLS). A client (the gateway towards its workers, or
``splitspec generate``) has the matching ``token``, ``ca``, ``cert`` and ``key`` settings.
Certificates and keys are PEM files given by path. Tokens are best set through the environment
(``SPLITSPEC_<SERVICE>_AUTH_TOKEN``) so they do not show in process listings.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class ServerSecurity:
    token: str = ""
    cert: str = ""
    key: str = ""
    client_ca: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        return cls(args.auth_token, args.tls_cert, args.tls_key, args.tls_client_ca)

    def credentials(self) -> grpc.ServerCredentials | None:
        if not (self.cert or self.key):
            if self.client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (self.cert and self.key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        pair = [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))]
        if self.client_ca:
            return grpc.ssl_server_credentials(pair, _read(self.client_ca, "--tls-client-ca"), require_client_auth=True)
        return grpc.ssl_server_credentials(pair)


@dataclass(frozen=True)
class ClientSecurity:
    token: str = ""
    ca: str = ""  # verify the server with this CA (enables TLS)
    cert: str = ""  # client certificate, for mutual TLS
    key: str = ""
    server_name: str = ""  # expected name in the server certificate, when it differs from the host

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.ca or self.cert):
            return None
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both cert and key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA") if self.ca else None,
            private_key=_read(self.key, "client key") if self.key else None,
            certificate_chain=_read(self.cert, "client certificate") if self.cert else None,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auth-token", default="", help="require this bearer token from clients (empty = no auth)")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="PEM CA: require client certificates it signed (mutual TLS)")


def add_client_arguments(p: argparse.ArgumentParser, prefix: str, peer: str) -> None:
    """Flags ``--{prefix}token``, ``--{prefix}ca``, ``--{prefix}cert``, ``--{prefix}key`` for calls to ``peer``."""
    p.add_argument(f"--{prefix}token", default="", help=f"bearer token sent to the {peer}")
    p.add_argument(f"--{prefix}ca", default="", help=f"PEM CA that signed the {peer}'s certificate (enables TLS)")
    p.add_argument(f"--{prefix}cert", default="", help=f"PEM client certificate for mutual TLS with the {peer}")
    p.add_argument(f"--{prefix}key", default="", help="PEM private key of that client certificate")
    p.add_argument(f"--{prefix}server-name", default="", help=f"name expected in the {peer}'s certificate")


def client_security(args: argparse.Namespace, prefix: str) -> ClientSecurity:
    attr = prefix.replace("-", "_")
    get = lambda name: getattr(args, attr + name)  # noqa: E731
    return ClientSecurity(get("token"), get("ca"), get("cert"), get("key"), get("server_name"))
