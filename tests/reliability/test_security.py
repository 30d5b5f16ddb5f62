"""Security on a live stack: loopback-only listening by default, gateway API keys (HTTP Bearer,
gRPC metadata), and the maximum gRPC message size of every stage with a clear error."""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from easerve import Client
from easerve.errors import MessageTooLarge, Unauthenticated
from easerve.healthcheck import check
from easerve.models.tiny import cached_tiny
from easerve.stages.common.configs import STAGE_CONFIGS, GatewayConfig
from easerve.stages.common.argv import from_argv
from hasctl.deployment import preset, to_commands
from hasctl.launch import Stack, assign_ports
from easerve.stages.gateway.auth import ApiKeys, read_key_file

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
LIMIT_MB = 4


# ---- listening addresses --------------------------------------------------------------------
def test_every_stage_listens_on_loopback_unless_told_otherwise():
    for stage, cls in STAGE_CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.name in ("listen", "http_listen"):
                assert f.default.rpartition(":")[0] == "127.0.0.1", (stage, f.name, f.default)
            if f.name == "metrics_listen":
                assert f.default == "", (stage, "metrics are off unless --metrics-listen is given")
    d = preset("colocated").with_model("/m")
    for c in to_commands(d, "127.0.0.1", assign_ports(d)):  # what `hasctl up` runs without --host
        listens = [c.argv[i + 1] for i, a in enumerate(c.argv) if a in ("--listen", "--http-listen")]
        assert listens and all(a.startswith("127.0.0.1:") for a in listens), c.argv


def _listening(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of the TCP sockets `pid` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ip_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(ip_hex)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                ip = ipaddress.ip_address(words)
                ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
                out.add((str(ip), int(port_hex, 16)))
    return out


# ---- API keys, unit ------------------------------------------------------------------------
def test_api_keys_compare_the_bearer_token(tmp_path):
    keys = ApiKeys(KEYS)
    assert keys.refusal(f"Bearer {KEYS[1]}") is None and keys.refusal(f"bearer  {KEYS[0]} ") is None
    assert "no API key" in keys.refusal(None) and "no API key" in keys.refusal(f"Basic {KEYS[0]}")
    assert keys.refusal(f"Bearer {KEYS[0]}x") == "the API key sent is not valid here"
    assert ApiKeys(()).refusal(None) is None  # no keys set: nothing asked
    f = tmp_path / "keys"
    f.write_text(f"# gateway keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    assert read_key_file(str(f)) == KEYS
    f.write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(str(f))


def test_api_key_flags_repeat_and_come_from_the_environment(monkeypatch):
    base = ["--model", "/m", "--prefill", "h:1", "--decode", "h:2"]
    monkeypatch.setenv("EASERVE_API_KEY", "from-env")
    assert from_argv(GatewayConfig, "gateway", base).api_key == ("from-env",)
    cfg = from_argv(GatewayConfig, "gateway", [*base, "--api-key", "a", "--api-key", "b,c"])
    assert cfg.api_key == ("a", "b", "c") and "'a'" not in repr(cfg)  # keys stay out of logs


# ---- a live stack: keys and message limits ---------------------------------------------------
@pytest.fixture(scope="module")
def sec_stack(tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "api-keys"
    keyfile.write_text("\n".join(KEYS) + "\n")
    model = str(cached_tiny("qwen2.5-vl", os.environ.get("EASERVE_TINY_CACHE") or "/tmp/easerve-tiny"))
    d = preset("default").with_model(model).with_gateway_ports(0, 0)
    d = d.with_flags("decode", num_slots=4, max_seq_len=512, threads=1, max_message_mb=LIMIT_MB)
    d = d.with_flags("encode", threads=1, max_message_mb=LIMIT_MB).with_flags("prefill", threads=1,
                                                                               max_message_mb=LIMIT_MB)
    d = d.with_flags("gateway", api_key_file=str(keyfile), max_message_mb=64)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING", "EASERVE_API_KEY": ""})
    stack.start(timeout=420)
    yield stack
    stack.stop()


def _http(stack, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(stack.endpoints.http + path, headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, dict(r.headers), (json.loads(raw) if r.headers.get_content_type() == "application/json"
                                               else {})
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _chat(model: str, content, max_tokens: int = 2) -> dict:
    return {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}


@pytest.mark.slow
def test_a_live_stack_listens_on_loopback_only(sec_stack):
    for name, pid in sec_stack.pids.items():
        addrs = _listening(pid)
        assert addrs and {ip for ip, _ in addrs} == {"127.0.0.1"}, (name, addrs)


@pytest.mark.slow
def test_http_needs_a_valid_key_but_health_does_not(sec_stack):
    status, headers, body = _http(sec_stack, "/v1/models", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
    assert "Authorization: Bearer" in body["error"]["message"]
    status, _, body = _http(sec_stack, "/v1/models", KEYS[0] + "-not")
    assert status == 401 and body["error"]["message"] == "the API key sent is not valid here"
    assert _http(sec_stack, "/metrics", None)[0] == 401
    status, _, body = _http(sec_stack, "/v1/models", KEYS[1])
    assert status == 200
    model = body["data"][0]["id"]
    assert _http(sec_stack, "/v1/chat/completions", None, _chat(model, "hi"))[0] == 401
    status, _, body = _http(sec_stack, "/v1/chat/completions", KEYS[0], _chat(model, "hi"))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert _http(sec_stack, "/health", None)[0] == 200

    import openai
    good = openai.OpenAI(base_url=sec_stack.endpoints.openai_base_url, api_key=KEYS[1], max_retries=0)
    assert good.models.list().data[0].id == model
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=sec_stack.endpoints.openai_base_url, api_key="sk-wrong", max_retries=0).models.list()


@pytest.mark.slow
def test_grpc_needs_a_valid_key_but_health_does_not(sec_stack):
    addr = sec_stack.endpoints.grpc
    for key in ("", "sk-wrong"):
        with Client(addr, timeout=30, api_key=key) as c, pytest.raises(Unauthenticated):
            c.list_models()
        with Client(addr, timeout=30, api_key=key) as c, pytest.raises(Unauthenticated):
            c.generate("hi", max_tokens=2)
    with Client(addr, timeout=60, api_key=KEYS[0]) as c:
        assert c.generate("hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    assert check(addr, "easerve.v1.Gateway") == "SERVING"  # probes need no key


@pytest.mark.slow
def test_every_stage_refuses_a_message_over_its_limit_with_a_clear_error(sec_stack):
    over = b"\0" * ((LIMIT_MB << 20) + 1024)
    for name, method in (("decode-0", "/easerve.v1.Decode/Submit"), ("prefill-0", "/easerve.v1.Prefill/Prefill"),
                         ("encode-0", "/easerve.v1.Encode/Encode")):
        with grpc.insecure_channel(sec_stack.endpoints.stages[name]) as ch:
            call = ch.unary_unary(method) if name == "decode-0" else ch.unary_stream(method)
            with pytest.raises(grpc.RpcError) as e:
                out = call(over, timeout=30)
                if name != "decode-0":
                    next(out)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
        assert f"larger than max ({len(over)} vs. {LIMIT_MB << 20})" in e.value.details(), name
    with Client(sec_stack.endpoints.grpc, timeout=60, api_key=KEYS[0]) as c:  # the gateway's limit: 64 MiB
        with pytest.raises(MessageTooLarge, match=r"over the gRPC limit of 67108864 bytes \(--max-message-mb"):
            c.generate("hi", images=[b"\x89PNG" + b"\0" * (64 << 20)], max_tokens=2)
        assert c.generate("hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_a_message_over_a_stage_limit_maps_to_413_not_429():
    """What the gateway makes of a stage's too-large refusal (a real server, 4 MiB limit)."""
    import asyncio
    from easerve.rpc.errors import from_rpc_error, http_status
    from easerve.rpc.server import ServerOptions, serve

    async def main():
        stop, ports = asyncio.Event(), []
        task = asyncio.create_task(serve([], "127.0.0.1:0", stop=stop, grace_s=0.1, on_bound=ports.append,
                                         options=ServerOptions(max_message_bytes=LIMIT_MB << 20)))
        try:
            while not ports:
                await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as ch:
                try:
                    await ch.unary_unary("/grpc.health.v1.Health/Check")(b"\0" * (5 << 20), timeout=10)
                except grpc.aio.AioRpcError as e:
                    return from_rpc_error(e)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    err = asyncio.run(main())
    assert isinstance(err, MessageTooLarge) and http_status(err) == 413
    assert str(err) == (f"a message of {5 << 20} bytes is over the gRPC limit of {LIMIT_MB << 20} bytes "
                        "(--max-message-mb of the process that received it); send smaller media or raise that limit")
