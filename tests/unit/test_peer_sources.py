"""Peer addresses that change while a stage runs: DNS names become one peer per address and are
looked up again, the launcher's peers file is read again when it changes, and `Peers` applies
each new list (added instances get calls once SERVING, removed ones only finish theirs).

Real gRPC servers (grpc.health.v1 + easerve.v1.Stage) in this process; the poll is driven by
`Peers.poll_once()` and the clock of `PeerSource` is injected, so nothing here waits on time.
"""
from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from easerve.errors import MessageTooLarge, Unavailable
from easerve.rpc.server import ServerOptions, serve
from easerve.stages.common import load as stage_load
from easerve.stages.common.configs import GatewayConfig, PrefillConfig
from easerve.stages.common.peer_sources import PeerSource, PeersFile, resolve_addr, split_hostport, write_peers_file
from easerve.stages.common.peers import Peers, peers_of
from easerve.transport.node import local_identity
from easerve.wire.v1 import prefill_pb2_grpc


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fake_dns(answers: dict[str, list[str] | None]):
    """getaddrinfo answering from `answers` (host -> IPs; None: the name does not resolve)."""
    def getaddrinfo(host, port, type=0, **_):
        ips = answers[host]
        if ips is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in ips]
    return getaddrinfo


# ---- addresses and DNS ---------------------------------------------------------------------------
def test_a_real_name_resolves_to_ip_addresses():
    got = resolve_addr("localhost:50053")
    assert "127.0.0.1:50053" in got
    for a in got:
        host, port = split_hostport(a)
        assert port == 50053 and (host == "127.0.0.1" or host == "::1")


def test_every_record_of_a_name_is_one_address_without_repeats():
    dns = fake_dns({"easerve-prefill.ns.svc": ["10.0.0.7", "fd00::7", "10.0.0.7", "10.0.0.8"]})
    assert resolve_addr("easerve-prefill.ns.svc:50053", dns) == ["10.0.0.7:50053", "[fd00::7]:50053",
                                                                "10.0.0.8:50053"]
    assert resolve_addr("[::1]:7", dns) == ["[::1]:7"] and resolve_addr("10.1.2.3:7", dns) == ["10.1.2.3:7"]


@pytest.mark.parametrize("bad", ["prefill", "prefill:", ":50053", "prefill:http", "prefill:0", "prefill:70000"])
def test_a_bad_address_says_what_to_change(bad):
    with pytest.raises(ValueError, match="must be host:port"):
        split_hostport(bad)


def test_names_are_looked_up_again_when_their_time_comes():
    answers = {"prefill": ["10.0.0.1"]}
    clock = Clock()
    src = PeerSource(["prefill:50053", "10.9.9.9:50053"], "prefill", refresh_s=5.0, clock=clock,
                     getaddrinfo=fake_dns(answers))
    assert not src.static and src.due()  # never resolved
    assert asyncio.run(src.resolve()) == ["10.0.0.1:50053", "10.9.9.9:50053"]
    assert not src.due()
    clock.t += 4.9
    assert not src.due()
    clock.t += 0.2
    assert src.due()
    answers["prefill"] = ["10.0.0.1", "10.0.0.2"]  # a pod became ready
    assert asyncio.run(src.resolve()) == ["10.0.0.1:50053", "10.0.0.2:50053", "10.9.9.9:50053"]
    answers["prefill"] = None  # DNS down: keep what the name had
    assert asyncio.run(src.resolve()) == ["10.0.0.1:50053", "10.0.0.2:50053", "10.9.9.9:50053"]


def test_ip_literals_alone_are_static_and_never_due_again():
    src = PeerSource(["127.0.0.1:1", "[::1]:2"])
    assert src.static and src.static_addrs() == ["127.0.0.1:1", "[::1]:2"]
    assert PeerSource(["127.0.0.1:1"], "decode", peers_file="/x/peers.json").static is False
    with pytest.raises(ValueError, match="--peer-refresh-s"):
        PeerSource(["a:1"], refresh_s=0)


# ---- the launcher's file -------------------------------------------------------------------------
def test_the_peers_file_is_read_again_exactly_when_it_changes(tmp_path):
    path = tmp_path / "gateway.peers.json"
    f = PeersFile(path)
    assert not f.changed() and f.read() is None  # no file yet
    write_peers_file(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    assert f.changed()
    assert f.read() == {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    assert not f.changed()
    write_peers_file(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})  # same text, new file
    assert f.changed()
    f.read()
    path.unlink()
    assert f.changed() and f.read() is None
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_a_role_the_file_lists_replaces_the_flag_and_a_broken_file_keeps_the_last_list(tmp_path):
    path = tmp_path / "p.json"
    src = PeerSource(["127.0.0.1:1"], "prefill", peers_file=str(path))
    assert asyncio.run(src.resolve()) == ["127.0.0.1:1"]  # no file: the flag's list
    write_peers_file(path, {"prefill": ["127.0.0.1:2", "127.0.0.1:3"]})
    assert src.due() and asyncio.run(src.resolve()) == ["127.0.0.1:2", "127.0.0.1:3"]
    path.write_text(json.dumps({"prefill": "127.0.0.1:4"}))  # not a list
    assert src.due() and asyncio.run(src.resolve()) == ["127.0.0.1:2", "127.0.0.1:3"]
    write_peers_file(path, {"decode": ["127.0.0.1:9"]})  # the file no longer names this role
    assert asyncio.run(src.resolve()) == ["127.0.0.1:1"]


def test_the_stage_configs_take_the_peer_flags():
    cfg = PrefillConfig(model="m", decode=("decode:50054",), peers_file="/run/p.json", peer_refresh_s=2.0)
    assert cfg.peers_file == "/run/p.json"
    with pytest.raises(ValueError, match="--peer-refresh-s must be > 0"):
        GatewayConfig(model="m", prefill=("a:1",), decode=("b:2",), peer_refresh_s=0)


# ---- Peers applying new lists, with real servers -----------------------------------------------
async def _server(stop: asyncio.Event, ports: list[int], options: ServerOptions) -> None:
    async def load():
        return stage_load.Load(0, 8)
    servicer = stage_load.StageServicer("prefill", local_identity("cpu"), load)
    await serve([stage_load.adder(servicer)], "127.0.0.1:0", health_services=["easerve.v1.Prefill"],
                stop=stop, grace_s=0, on_bound=ports.append, options=options)


async def _servers(n: int, options: ServerOptions = ServerOptions()):
    stops, ports, tasks = [asyncio.Event() for _ in range(n)], [], []
    for s in stops:
        tasks.append(asyncio.ensure_future(_server(s, ports, options)))
        while len(ports) < len(tasks):
            await asyncio.sleep(0.01)
    for port in ports:  # SERVING follows the bind (no warm-up): wait for it, by asking
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while (await stub.Check(health_pb2.HealthCheckRequest(service="easerve.v1.Prefill"))).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.01)
    return stops, ports, tasks


async def _stop(peers: Peers, stops: list[asyncio.Event], tasks: list) -> None:
    await peers.close()
    for s in stops:
        s.set()
    await asyncio.gather(*tasks)


def test_peers_follow_the_file_added_gets_calls_removed_finishes_then_is_closed(tmp_path):
    async def main():
        stops, (p0, p1), tasks = await _servers(2)
        a0, a1 = f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"
        path, closed = tmp_path / "gateway.peers.json", []

        async def on_closed(addr):
            closed.append(addr)
        cfg = GatewayConfig(model="m", prefill=(a0,), decode=(a0,), peers_file=str(path))
        peers = peers_of(cfg, "prefill", prefill_pb2_grpc.PrefillStub, (), "easerve.v1.Prefill",
                         on_closed=on_closed)
        try:
            assert peers and peers.addrs == []  # nothing listed before the first look-up
            await peers.poll_once()
            assert peers.addrs == [a0] and peers.get(a0).up and peers.get(a0).capacity == 8

            write_peers_file(path, {"prefill": [a0, a1], "decode": [a0]})
            await peers.poll_once()
            assert peers.addrs == [a0, a1] and peers.get(a1).up
            assert {peers.pick().addr for _ in range(4)} == {a0, a1}  # the new instance gets calls

            old = peers.get(a0)
            old.outstanding += 1  # a call still open on it
            write_peers_file(path, {"prefill": [a1], "decode": [a0]})
            await peers.poll_once()
            assert peers.addrs == [a1] and peers.retired == [a0]
            assert peers.get(a0) is old and closed == []  # its open call may finish
            assert {peers.pick().addr for _ in range(6)} == {a1}
            with pytest.raises(Unavailable, match="no .* instance left to try"):
                peers.pick(exclude=frozenset({a1}))
            peers.finish(old)
            await peers.poll_once()  # still reachable: it may hold work that needs calls (a drain)
            assert peers.retired == [a0] and closed == [] and peers.get(a0) is old
            stops[0].set()  # it exits
            await asyncio.wait_for(tasks[0], 10)
            await peers.poll_once()
            assert peers.retired == [] and closed == [a0] and peers.get(a0) is None

            write_peers_file(path, {"prefill": [], "decode": [a0]})
            await peers.poll_once()
            with pytest.raises(Unavailable, match="no easerve.v1.Prefill instance is listed now"):
                peers.pick()
        finally:
            await _stop(peers, stops, tasks)
    asyncio.run(main())


def test_a_real_name_becomes_its_addresses_and_a_new_address_waits_for_its_first_poll():
    async def main():
        stops, (port,), tasks = await _servers(1)
        peers = Peers(prefill_pb2_grpc.PrefillStub, [f"localhost:{port}"], service="easerve.v1.Prefill")
        try:
            assert peers.addrs == []
            await peers.refresh()
            assert f"127.0.0.1:{port}" in peers.addrs
            assert not peers.get(f"127.0.0.1:{port}").up  # not a candidate before a poll says SERVING
            await peers.poll_once()
            assert peers.pick().addr in peers.addrs and peers.get(f"127.0.0.1:{port}").up
            assert await peers.lookup(f"127.0.0.1:{port}") is peers.get(f"127.0.0.1:{port}")
            assert await peers.lookup("127.0.0.1:1") is None  # looked up again: still not one of them
        finally:
            await peers.close()
            stops[0].set()
            await asyncio.gather(*tasks)
    asyncio.run(main())


def test_reach_of_waits_for_an_instance_that_started_listening_after_our_first_try():
    """The race CI met: prefill's channel tried decode before decode listened, so gRPC held it
    in reconnect backoff (~1 s) when the gateway, already seeing decode serving, handed prefill
    a reservation there. reach_of must connect first, not report an unknown identity."""
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        addr = f"127.0.0.1:{port}"
        peers = Peers(prefill_pb2_grpc.PrefillStub, [addr], service="easerve.v1.Prefill")
        stop, bound = asyncio.Event(), []
        try:
            await peers.poll_once()  # nothing listens yet: the channel fails and backs off
            assert not peers.get(addr).up

            async def load():
                return stage_load.Load(0, 8)
            servicer = stage_load.StageServicer("prefill", local_identity("cpu"), load)
            task = asyncio.ensure_future(serve([stage_load.adder(servicer)], addr, stop=stop, grace_s=0,
                                               health_services=["easerve.v1.Prefill"], on_bound=bound.append))
            while not bound:
                await asyncio.sleep(0.01)
            node, shared = await peers.reach_of(addr)
            assert node == local_identity("cpu") and shared is True
        finally:
            await peers.close()
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def test_a_message_over_the_size_limit_is_not_retried_on_another_instance():
    """RESOURCE_EXHAUSTED "message larger than max" is refused by every instance alike: the
    call is tried once and surfaces as MessageTooLarge, not as a retry (nor as Overloaded)."""
    async def main():
        stops, ports, tasks = await _servers(2, ServerOptions(max_message_bytes=4 << 20))  # 4 MiB each
        peers = Peers(lambda ch: ch.unary_stream("/grpc.health.v1.Health/Watch"),  # a streaming method they serve
                      [f"127.0.0.1:{p}" for p in ports], service="easerve.v1.Prefill")
        opened: list[str] = []

        def open_call(peer):
            opened.append(peer.addr)
            return peer.stub(b"\0" * (5 << 20), timeout=10)
        try:
            with pytest.raises(MessageTooLarge, match=r"easerve.v1.Prefill at 127.0.0.1:\d+: a message of 5242880 "
                                                      r"bytes is over the gRPC limit of 4194304 bytes"):
                await peers.start_call(open_call)
            assert len(opened) == 1, opened  # not retried: it would not fit the other instance either
            assert all(p.outstanding == 0 for p in map(peers.get, peers.addrs))
        finally:
            await _stop(peers, stops, tasks)
    asyncio.run(main())


def test_a_call_whose_instance_left_the_list_meanwhile_is_retried_on_another(tmp_path):
    """The race CI met while prefill instances came and went: a call opened on an instance that
    the next poll removed (and whose process was gone) failed UNAVAILABLE with one instance left
    listed; that one must still get the retry, since nothing was committed anywhere."""
    async def main():
        stops, (port,), tasks = await _servers(1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            gone = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there any more
        live, path = f"127.0.0.1:{port}", tmp_path / "encode.peers.json"
        write_peers_file(path, {"prefill": [gone, live]})
        cfg = GatewayConfig(model="m", prefill=(gone,), decode=(gone,), peers_file=str(path))
        peers = peers_of(cfg, "prefill", lambda ch: ch.unary_stream("/grpc.health.v1.Health/Watch"), (),
                         "easerve.v1.Prefill")
        opened: list[str] = []

        def open_call(peer):
            opened.append(peer.addr)
            if peer.addr == gone:  # the poll that follows finds it removed from the list
                write_peers_file(path, {"prefill": [live]})
                asyncio.ensure_future(peers.refresh())
            return peer.stub(health_pb2.HealthCheckRequest(service="easerve.v1.Prefill").SerializeToString(),
                             timeout=10)
        try:
            await peers.refresh()
            peers.get(gone).up = peers.get(live).up = True
            _, call, first = await peers.start_call(open_call, prefer=gone)
            call.cancel()
            assert opened == [gone, live] and first  # retried on the instance still listed
        finally:
            await _stop(peers, stops, tasks)
    asyncio.run(main())
