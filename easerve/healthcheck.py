"""`python -m easerve.healthcheck HOST:PORT [SERVICE]`: exit 0 iff grpc.health.v1 says SERVING.

For container healthchecks (docker compose, Kubernetes exec probes). SERVICE defaults to ""
(the whole server); stages also report their own, e.g. easerve.v1.Decode. A stage serving
TLS is checked with --tls-ca (and --tls-cert / --tls-key where it asks for client certificates).
"""
from __future__ import annotations

import argparse
import sys


def check(addr: str, service: str = "", timeout: float = 3.0, tls=None) -> str:
    """The health status name ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN") or "UNREACHABLE: <details>".
    `tls`: an easerve.rpc.tls.Tls for a server that serves TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from easerve.rpc.tls import NO_TLS, sync_channel

    with sync_channel(addr, (), tls or NO_TLS) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"  # the server runs, but does not report this service
            return f"UNREACHABLE: {e.code().name} {e.details() or ''}".strip()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m easerve.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("addr", help="host:port of a gRPC server")
    p.add_argument("service", nargs="?", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    for name in ("ca", "cert", "key"):
        p.add_argument(f"--tls-{name}", default="", help=f"PEM {name} file, for a server that serves TLS")
    args = p.parse_args(argv)
    from easerve.rpc.tls import Tls
    try:
        tls = Tls(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        p.error(str(e))
    status = check(args.addr, args.service, args.timeout, tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
