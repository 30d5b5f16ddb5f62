"""The gateway's API keys: `--api-key` (repeatable, or $EASERVE_API_KEY) and `--api-key-file`.

With keys set, every HTTP route but GET /health needs `Authorization: Bearer KEY` (else 401,
an OpenAI-style error body), and every easerve.v1.Gateway gRPC call the metadata
`authorization: Bearer KEY` (else UNAUTHENTICATED); the gRPC health service stays open, for
probes. A key is compared with every configured key in constant time (hmac.compare_digest),
all of them, so timing tells nothing about which one came close. Without keys, nothing is asked.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from pathlib import Path

import grpc
from aiohttp import web

log = logging.getLogger("easerve.gateway")
OPEN_HTTP_PATHS = frozenset({"/health"})
GATEWAY_METHODS = "/easerve.v1.Gateway/"
MISSING = "no API key: send the header 'Authorization: Bearer <key>'"
WRONG = "the API key sent is not valid here"


def read_key_file(path: str) -> tuple[str, ...]:
    """Keys from a file, one a line; blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file {path!r}: {e.strerror}") from None
    keys = tuple(x.strip() for x in lines if x.strip() and not x.strip().startswith("#"))
    if not keys:
        raise ValueError(f"--api-key-file {path!r} holds no key (one a line)")
    return keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = tuple(k.encode() for k in keys)
        if any(not k or b" " in k for k in self._keys):
            raise ValueError("API keys must be non-empty and hold no spaces")

    @classmethod
    def of(cls, cfg) -> ApiKeys:
        return cls((*cfg.api_key, *(read_key_file(cfg.api_key_file) if cfg.api_key_file else ())))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def refusal(self, authorization: str | None) -> str | None:
        """None when `authorization` (the header's value) carries a valid key (or no keys are
        set); else why not."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING
        sent, ok = token.strip().encode(), False
        for k in self._keys:  # no early exit
            ok |= hmac.compare_digest(sent, k)
        return None if ok else WRONG


def http_middleware(keys: ApiKeys):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if request.path not in OPEN_HTTP_PATHS:
            why = keys.refusal(request.headers.get("Authorization"))
            if why is not None:
                body = {"error": {"message": why, "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}}
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check_key


class GrpcAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for an easerve.v1.Gateway call without a valid key; other services pass."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(GATEWAY_METHODS):
            return handler
        md = {k.lower(): v for k, v in (details.invocation_metadata or ())}
        why = self.keys.refusal(md.get("authorization"))
        return handler if why is None else _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def warn_if_open(cfg, keys: ApiKeys) -> None:
    """Log a warning when the gateway listens beyond loopback with no key or no TLS."""
    wide = [a for a in (cfg.listen, cfg.http_listen) if not _loopback(a.rpartition(":")[0])]
    if wide and not keys.enabled:
        log.warning("listening on %s with no API key: anyone who reaches it may use it (set --api-key-file)",
                    ", ".join(wide))
    if wide and not cfg.tls_cert:
        log.warning("listening on %s without TLS: keys and requests cross the network in clear "
                    "(set --tls-cert / --tls-key)", ", ".join(wide))


def _loopback(host: str) -> bool:
    return host.strip("[]") in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


__all__ = ["ApiKeys", "GrpcAuth", "http_middleware", "read_key_file", "warn_if_open"]
