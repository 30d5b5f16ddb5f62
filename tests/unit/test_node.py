"""Node identities, the shared-memory probe, and the transport each pair of processes gets."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest

from easerve.transport.handoff import KVSenders, choose_kind
from easerve.transport.node import NodeIdentity, host_id, local_identity, read_probe, shm_probe


def _child_reads(q_in, q_out) -> None:
    while (msg := q_in.get()) is not None:
        q_out.put(read_probe(msg))


def test_another_process_reads_the_probe_and_it_is_gone_after():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(q_in, q_out))
    child.start()
    try:
        with shm_probe() as (name, token):
            assert name.startswith("easerve-probe-") and len(token) == 32
            q_in.put(name)
            assert q_out.get(timeout=60) == token
        q_in.put(name)
        assert q_out.get(timeout=60) is None  # unlinked on exit: nothing left in /dev/shm
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        q_in.put(None)
        child.join(30)


def test_probe_names_outside_ours_are_not_opened():
    assert read_probe("../etc/passwd") is None and read_probe("libpod_lock") is None and read_probe("") is None


def test_transport_choice_from_identity_and_probe():
    me = local_identity("cpu")
    assert choose_kind(me, NodeIdentity(me.host_id), True) == ("shm", "shared /dev/shm")
    assert choose_kind(me, NodeIdentity(me.host_id), False) == ("grpc", "same host, separate /dev/shm")
    assert choose_kind(me, NodeIdentity("other-boot"), False) == ("grpc", "another host")
    assert choose_kind(me, None, True)[0] == "grpc"
    gpu = NodeIdentity(me.host_id, "cuda:0", "GPU-a")
    same_gpu = NodeIdentity(me.host_id, "cuda:1", "GPU-a")  # another CUDA_VISIBLE_DEVICES, one GPU
    assert choose_kind(gpu, same_gpu, True) == ("cuda_ipc", "same host, shared /dev/shm, one GPU")
    assert choose_kind(gpu, same_gpu, False)[0] == "grpc"
    # two GPUs of one host (even both called cuda:0 in their processes): not CUDA IPC
    assert choose_kind(gpu, NodeIdentity(me.host_id, "cuda:0", "GPU-b"), True) == ("shm", "shared /dev/shm; GPUs differ")
    assert choose_kind(gpu, NodeIdentity(me.host_id, "cuda:0"), True)[0] == "shm"  # unknown UUID
    assert choose_kind(gpu, NodeIdentity("other-boot", "cuda:1"), True)[0] == "shm"  # shm readable: not cuda ipc


def test_host_id_is_the_kernels_boot_id():
    assert host_id() == open("/proc/sys/kernel/random/boot_id").read().strip()


def test_senders_pick_once_per_peer_and_share_one_shm_transport():
    me = local_identity("cpu")
    looked = []

    async def reach_of(addr):
        looked.append(addr)
        return (me, True) if addr.startswith("local") else (NodeIdentity("elsewhere"), False)

    async def main():
        s = KVSenders(me, reach_of)
        a, b, c = [await s.transport_for(x) for x in ("local:1", "local:2", "remote:3")]
        again = await s.transport_for("local:1")
        assert a is b is again and a.name == "shm" and c.name == "grpc"
        assert looked == ["local:1", "local:2", "remote:3"]
        assert s.choices["remote:3"] == ("grpc", "another host")
        forced = KVSenders(me, reach_of, kind="grpc")
        assert (await forced.transport_for("local:1")).name == "grpc"
        await s.close()
        await forced.close()
    asyncio.run(main())
    with pytest.raises(ValueError, match="kv-transport"):
        KVSenders(me, reach_of, kind="nccl")
