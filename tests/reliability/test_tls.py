"""TLS with certificates the test makes (openssl): on easerve's gRPC server, and on a live stack
(gateway gRPC + HTTP, every stage, the KV stream) with mutual TLS, where a plaintext client, a
client trusting another CA and a client without a certificate are all refused."""
from __future__ import annotations

import asyncio
import json
import socket
import ssl
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from easerve import Client
from easerve.errors import Unavailable
from easerve.healthcheck import check
from easerve.models.tiny import cached_tiny
from easerve.rpc.server import ServerOptions, serve
from easerve.rpc.tls import Tls, aio_channel
from hasctl.deployment import preset
from hasctl.launch import Stack
from tests.reliability.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("other-pki"), "not-ours")


async def _health_via(port: int, tls: Tls) -> str:
    async with aio_channel(f"127.0.0.1:{port}", tls=tls) as ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _served(server_tls: Tls, clients: dict[str, Tls]) -> dict[str, str]:
    async def main():
        stop, ports = asyncio.Event(), []
        task = asyncio.create_task(serve([], "127.0.0.1:0", stop=stop, grace_s=0.1, on_bound=ports.append,
                                         options=ServerOptions(tls=server_tls)))
        try:
            while not ports:
                await asyncio.sleep(0.01)
            return {name: await _health_via(ports[0], t) for name, t in clients.items()}
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    return asyncio.run(main())


def test_tls_server_accepts_only_clients_that_trust_its_ca(pki, other_pki):
    got = _served(Tls(pki.cert, pki.key), {"ours": Tls(ca=pki.ca), "plaintext": Tls(),
                                           "other ca": Tls(ca=other_pki.ca)})
    assert got == {"ours": "SERVING", "plaintext": "UNAVAILABLE", "other ca": "UNAVAILABLE"}


def test_mutual_tls_refuses_a_client_without_a_certificate(pki, other_pki):
    got = _served(Tls(pki.cert, pki.key, pki.ca, client_auth=True),
                  {"with cert": Tls(pki.cert, pki.key, pki.ca), "no cert": Tls(ca=pki.ca),
                   "cert of another ca": Tls(other_pki.cert, other_pki.key, pki.ca)})
    assert got == {"with cert": "SERVING", "no cert": "UNAVAILABLE", "cert of another ca": "UNAVAILABLE"}


def test_tls_flags_that_do_not_go_together_say_what_to_change(pki):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        Tls(cert=pki.cert)
    with pytest.raises(ValueError, match="--tls-client-auth needs --tls-ca"):
        Tls(pki.cert, pki.key, client_auth=True)
    with pytest.raises(ValueError, match="--tls-ca '/nonexistent.pem' is not a readable file"):
        Tls(ca="/nonexistent.pem")


# ---- a live stack, mutual TLS everywhere ----------------------------------------------------
@pytest.fixture(scope="module")
def tls_stack(pki):
    import os
    model = str(cached_tiny("qwen2.5-vl", os.environ.get("EASERVE_TINY_CACHE") or "/tmp/easerve-tiny"))
    d = preset("default").with_model(model).with_gateway_ports(0, 0)
    d = d.with_flags("decode", num_slots=4, max_seq_len=512, threads=1).with_flags("encode", threads=1)
    d = d.with_flags("prefill", threads=1, kv_transport="grpc")  # the KV crosses a TLS gRPC stream too
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"}, tls=Tls(pki.cert, pki.key, pki.ca, client_auth=True))
    stack.start(timeout=420)
    yield stack
    stack.stop()


def _https(stack, pki, body: dict) -> tuple[int, dict]:
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.load_cert_chain(pki.cert, pki.key)
    req = urllib.request.Request(stack.endpoints.http.replace("http://", "https://") + "/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
        return r.status, json.loads(r.read())


@pytest.mark.slow
def test_a_live_stack_serves_end_to_end_over_mutual_tls(tls_stack, pki):
    from tests.support.media import data_uri, png_bytes
    with Client(tls_stack.endpoints.grpc, timeout=120, tls=Tls(pki.cert, pki.key, pki.ca)) as c:
        out = c.generate("Describe.", images=[png_bytes(64, 64, 1)], max_tokens=4, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    content = [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(48, 48, 2))}},
               {"type": "text", "text": "What is it?"}]
    status, body = _https(tls_stack, pki, {"model": _model_id(tls_stack, pki), "max_tokens": 3, "ignore_eos": True,
                                           "messages": [{"role": "user", "content": content}]})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def _model_id(stack, pki) -> str:
    with Client(stack.endpoints.grpc, timeout=30, tls=Tls(pki.cert, pki.key, pki.ca)) as c:
        return c.list_models()[0].id


@pytest.mark.slow
def test_a_live_tls_stack_refuses_plaintext_and_strangers(tls_stack, pki, other_pki):
    grpc_addr = tls_stack.endpoints.grpc
    for tls in (Tls(), Tls(ca=pki.ca), Tls(other_pki.cert, other_pki.key, other_pki.ca)):
        with Client(grpc_addr, timeout=10, tls=tls) as c, pytest.raises(Unavailable):
            c.list_models()
    for name in ("decode-0", "prefill-0", "encode-0", "gateway"):
        addr = tls_stack.endpoints.stages[name]
        assert check(addr, timeout=3).startswith("UNREACHABLE: UNAVAILABLE"), name  # plaintext
        assert check(addr, timeout=3, tls=Tls(pki.cert, pki.key, pki.ca)) == "SERVING", name
    host, port = tls_stack.endpoints.http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:  # plaintext HTTP on the TLS port
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(64)
    assert not answer.startswith(b"HTTP/"), answer
