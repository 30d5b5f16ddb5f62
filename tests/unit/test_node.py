"""Node identities and the transport each pair of processes gets from them."""
from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import pytest

from easerve.transport.handoff import KVSenders, choose_kind
from easerve.transport.node import NodeIdentity, host_id, local_identity, reach, read_probe


def _child_identity(q) -> None:
    me = local_identity("cpu")
    q.put((me.host_id, me.shm_probe, me.shm_token))
    q.get()  # stay alive (probe in place) until the parent has looked


def test_another_process_on_this_host_shares_shm():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_child_identity, args=(q,))
    child.start()
    try:
        peer = NodeIdentity(*q.get(timeout=60))
        me = local_identity("cpu")
        assert peer.shm_probe != me.shm_probe
        assert reach(me, peer).same_host and reach(me, peer).shared_shm
        assert choose_kind(me, peer)[0] == "shm"
    finally:
        q.put("done")
        child.join(30)
    assert read_probe(peer.shm_probe) is None  # the probe goes with its process


def test_a_peer_whose_probe_this_process_cannot_read_gets_grpc():
    me = local_identity("cpu")
    other_container = NodeIdentity(me.host_id, "easerve-node-0-deadbeef", "00" * 16)
    assert reach(me, other_container).same_host and not reach(me, other_container).shared_shm
    assert choose_kind(me, other_container) == ("grpc", "same host, separate /dev/shm")
    # a probe with the right name but other bytes is another /dev/shm that happens to collide
    forged = NodeIdentity(me.host_id, me.shm_probe, "ff" * 16)
    assert not reach(me, forged).shared_shm
    other_host = NodeIdentity("another-boot-id", me.shm_probe, me.shm_token)
    assert choose_kind(me, other_host)[0] == "shm"  # readable probe with its bytes: shared, whatever the id says
    assert choose_kind(me, None)[0] == "grpc"


def test_gpu_pairs_on_shared_shm_get_cuda_ipc():
    me = local_identity("cpu")
    a = NodeIdentity(me.host_id, me.shm_probe, me.shm_token, "cuda:0")
    b = NodeIdentity(me.host_id, me.shm_probe, me.shm_token, "cuda:1")
    assert choose_kind(a, b)[0] == "cuda_ipc"
    assert choose_kind(a, NodeIdentity(me.host_id, "x", "y", "cuda:1"))[0] == "grpc"


def test_host_id_is_the_kernels_boot_id():
    assert host_id() == open("/proc/sys/kernel/random/boot_id").read().strip()




def test_senders_pick_once_per_peer_and_share_one_shm_transport():
    import asyncio

    me = local_identity("cpu")
    looked = []

    async def node_of(addr):
        looked.append(addr)
        return me if addr.startswith("local") else NodeIdentity("elsewhere")

    async def main():
        s = KVSenders(me, node_of)
        a, b, c = [await s.transport_for(x) for x in ("local:1", "local:2", "remote:3")]
        again = await s.transport_for("local:1")
        assert a is b is again and a.name == "shm" and c.name == "grpc"
        assert looked == ["local:1", "local:2", "remote:3"]
        assert s.choices["remote:3"][0] == "grpc"
        forced = KVSenders(me, node_of, kind="grpc")
        assert (await forced.transport_for("local:1")).name == "grpc"
        await s.close()
        await forced.close()
    asyncio.run(main())
    with pytest.raises(ValueError, match="kv-transport"):
        KVSenders(me, node_of, kind="nccl")
