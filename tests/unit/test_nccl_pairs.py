"""NCCL pair groups as instances come and go: ranks by role, the backend by the two devices,
the rendezvous address a decode instance advertises, and two prefill instances each forming
their own gloo pair with one decode instance's rendezvous (in one process, over real TCP),
delivering KV equal to the shared-memory path's, in any order; a broken pair fails fast."""
from __future__ import annotations

import asyncio
import time

import pytest

from easerve.errors import NotFound, Unavailable
from easerve.stages.common.configs import DecodeConfig
from easerve.stages.common.rendezvous import rendezvous_listen
from easerve.transport.handoff import KVSenders, choose_kind
from easerve.transport.nccl import DST, SRC, NcclConfig
from easerve.transport.nccl_pairs import PairRendezvous, PairTimeouts, _announce, _parse, backend_for, connect_pair
from easerve.transport.node import NodeIdentity
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.wire import codec
from tests.support.kv import kv, roundtrip

T = PairTimeouts(connect_s=20, send_s=10, recv_s=10)


def test_ranks_backend_and_announcement():
    assert (SRC, DST) == (0, 1)  # prefill sends as rank 0, decode receives as rank 1, whatever the count
    assert backend_for("cuda:0", "cuda:1") == "nccl"
    assert backend_for("cuda:0", "cpu") == backend_for("cpu", "cpu") == "gloo"
    assert _parse(_announce("h-1-ab", "gloo").encode()) == ("h-1-ab", "gloo")
    with pytest.raises(ValueError, match="malformed"):
        _parse(b"h-1-ab tcp")
    with pytest.raises(ValueError, match="rank"):
        NcclConfig(rank=2)
    with pytest.raises(ValueError, match="cuda"):
        NcclConfig(rank=0, backend="nccl", device="cpu")


def test_auto_choice_picks_nccl_for_gpus_without_shared_memory():
    me = NodeIdentity("h1", "cuda:0")
    far = NodeIdentity("h2", "cuda:0", kv_rendezvous="10.0.0.2:41000")
    assert choose_kind(me, far, False)[0] == "nccl"
    assert choose_kind(me, NodeIdentity("h2", "cuda:0"), False)[0] == "grpc"  # no rendezvous advertised
    assert choose_kind(NodeIdentity("h1", "cpu"), far, False)[0] == "grpc"  # a CPU end
    assert choose_kind(me, NodeIdentity("h1", "cuda:1", kv_rendezvous="x:1"), True)[0] != "nccl"  # shared shm


def test_rendezvous_address_from_the_deployment():
    assert rendezvous_listen(DecodeConfig(model="m", listen="10.1.2.3:50054", device="cuda:0")) == "10.1.2.3:0"
    # torch's store listens on every interface: none by default on loopback or on a CPU decode
    assert rendezvous_listen(DecodeConfig(model="m", listen="127.0.0.1:50054", device="cuda:0")) == ""
    assert rendezvous_listen(DecodeConfig(model="m", listen="10.1.2.3:50054")) == ""
    assert rendezvous_listen(DecodeConfig(model="m", kv_rendezvous="127.0.0.1:0")) == "127.0.0.1:0"
    assert rendezvous_listen(DecodeConfig(model="m", kv_rendezvous="10.1.2.3:29500")) == "10.1.2.3:29500"
    assert rendezvous_listen(DecodeConfig(model="m", kv_rendezvous="off")) == ""


def test_two_prefill_instances_pair_with_one_decode_and_match_the_shm_bytes():
    async def main():
        hub = PairRendezvous("127.0.0.1:0", "cpu", T)
        decode = NodeIdentity("h", "cpu", kv_rendezvous=hub.address)

        async def reach_of(addr):
            return decode, False

        a, b = (KVSenders(NodeIdentity("h", "cpu"), reach_of, kind="nccl") for _ in range(2))
        ta, tb = await asyncio.gather(a.transport_for("d:1"), b.transport_for("d:1"))
        for _ in range(100):  # the decode side registers a pair just after its group forms
            if len(hub.pairs) == 2:
                break
            await asyncio.sleep(0.05)
        assert ta.config.pair != tb.config.pair and set(hub.pairs) == {ta.config.pair, tb.config.pair}
        assert (ta.config.rank, ta.config.backend) == (SRC, "gloo")
        shm_tx, shm_rx = ShmTransport(), ShmTransport(ShmConfig(copy_out=True))
        pays = [kv(tokens=4 + i, rid=f"r{i}") for i in range(4)]
        handles = [await (ta if i % 2 else tb).send(p.request_id, *codec.kv_to_parts(p)) for i, p in enumerate(pays)]
        for p, h in reversed(list(zip(pays, handles))):  # any order, each from its own pair
            got = codec.kv_from_parts(*await hub.recv(h, timeout=10))
            _, via_shm = await roundtrip(shm_tx, shm_rx, p)
            frame = lambda payload: codec.join_parts(*codec.kv_to_parts(payload))  # noqa: E731
            assert frame(got) == frame(via_shm) == frame(p)
        with pytest.raises(NotFound, match="not formed"):
            await hub.recv(type(handles[0])("x", 0, 1, 1, 0, "nobody"), timeout=0.2)
        await a.forget("d:1")  # the prefill instance goes: its goodbye ends the pair's receive thread
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="closed the pair"):
            await hub.recv(type(handles[0])("y", 0, 1, 99, 0, ta.config.pair),
                           timeout=10)
        assert time.monotonic() - t0 < 5
        await b.close()
        await hub.close()
        await shm_tx.close()
    asyncio.run(main())


def test_a_decode_without_rendezvous_is_refused_by_name():
    async def main():
        async def reach_of(addr):
            return NodeIdentity("h", "cpu"), False
        s = KVSenders(NodeIdentity("h", "cpu"), reach_of, kind="nccl")
        with pytest.raises(Unavailable, match="--kv-rendezvous"):
            await s.transport_for("d:9")
        with pytest.raises(Unavailable, match="cannot form"):
            await connect_pair("127.0.0.1:1", "cpu", "cpu", PairTimeouts(connect_s=1))
    asyncio.run(main())
