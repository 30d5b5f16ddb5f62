"""TLS between the stages and on the gateway, and the one place gRPC channels are made.

A process given `--tls-cert` and `--tls-key` serves TLS on its gRPC port (the gateway on its
HTTP port too) and calls its peers over TLS, verifying them against `--tls-ca` (the system's
roots when it is not given) and presenting its own certificate, so a peer that sets
`--tls-client-auth` (mutual TLS: only clients with a certificate signed by its `--tls-ca`)
accepts it. TLS is all or nothing in a deployment: a plaintext client of a TLS server fails
its handshake (UNAVAILABLE), and a TLS client of a plaintext server too.

`aio_channel` / `sync_channel` make every easerve channel: TLS when a `Tls` with a
certificate or a CA is given, plaintext otherwise.
"""
from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc


def check_tls_flags(cert: str, key: str, ca: str, client_auth: bool) -> None:
    """The --tls-* flags that go together (files are checked where they are read: by `Tls`)."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both (PEM files) or neither")
    if client_auth and not (ca and cert):
        raise ValueError("--tls-client-auth needs --tls-ca (the CA client certificates are checked "
                         "against) and --tls-cert / --tls-key")


@dataclass(frozen=True)
class Tls:
    cert: str = ""                   # PEM certificate chain of this process (server, and client for mTLS)
    key: str = ""                    # its PEM private key
    ca: str = ""                     # PEM CA bundle: verifies the servers this process calls (and clients, mTLS)
    client_auth: bool = False        # servers require a client certificate signed by `ca`

    def __post_init__(self) -> None:
        check_tls_flags(self.cert, self.key, self.ca, self.client_auth)
        for flag, path in (("tls-cert", self.cert), ("tls-key", self.key), ("tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"--{flag} {path!r} is not a readable file")

    @property
    def serving(self) -> bool:
        """True when this process serves TLS."""
        return bool(self.cert)

    @property
    def calling(self) -> bool:
        """True when this process calls its peers over TLS."""
        return bool(self.cert or self.ca)

    def _read(self, path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca) if self.client_auth else None,
                                           require_client_auth=self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key), certificate_chain=self._read(self.cert))

    def server_ssl_context(self) -> ssl.SSLContext:
        """For the gateway's HTTP side (aiohttp)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_auth:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.ca)
        return ctx


NO_TLS = Tls()



def tls_of(cfg) -> Tls:
    """The Tls of a stage config (its --tls-* flags)."""
    return Tls(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_client_auth)


def aio_channel(target: str, options: Sequence = (), tls: Tls = NO_TLS) -> grpc.aio.Channel:
    if tls.calling:
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=list(options))
    return grpc.aio.insecure_channel(target, options=list(options))


async def connected(channel: grpc.aio.Channel, wait_s: float) -> bool:
    """Whether `channel` is connected, waiting up to `wait_s` for it: a call made on a channel
    still in reconnect backoff (from an attempt before its peer listened) fails at once with
    the old error."""
    if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
        return True
    try:
        await asyncio.wait_for(channel.channel_ready(), wait_s)
        return True
    except asyncio.TimeoutError:
        return False


def sync_channel(target: str, options: Sequence = (), tls: Tls = NO_TLS) -> grpc.Channel:
    if tls.calling:
        return grpc.secure_channel(target, tls.channel_credentials(), options=list(options))
    return grpc.insecure_channel(target, options=list(options))


def add_port(server, addr: str, tls: Tls) -> int:
    """Bind `addr` on a grpc(.aio) server, with TLS when `tls` serves it; the port bound (0: failed)."""
    if tls.serving:
        return server.add_secure_port(addr, tls.server_credentials())
    return server.add_insecure_port(addr)
