"""Embeddings through the KV transports (encode -> remote prefill): the choice per instance
(shared memory on one host, inline in the message elsewhere: a prefill serves no KVStream),
zero-copy views on the receiving side, the byte counts by transport, and no shared memory
left behind whether the receiver takes the payload or the call fails first."""
from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch

from easerve.errors import CodecError
from easerve.transport.handoff import KVSenders, embedding_receiver
from easerve.transport.node import NodeIdentity, local_identity
from easerve.wire import codec
from easerve.wire.v1 import kv_pb2

ME = local_identity("cpu")


async def _reach_of(addr: str):
    return (ME, True) if addr.startswith("local") else (NodeIdentity("elsewhere"), False)


def _embeds() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 16, generator=g), torch.randn(3, 16, generator=g).to(torch.bfloat16)]


def _wire(msg: kv_pb2.KVTransfer) -> kv_pb2.KVTransfer:
    return kv_pb2.KVTransfer.FromString(msg.SerializeToString())


def test_same_host_crosses_shared_memory_as_views_and_is_counted():
    async def main():
        senders, recv = KVSenders(ME, _reach_of, byte_stream=False), embedding_receiver("cpu")
        embeds = _embeds()
        msg, t = await senders.send_parts("local:1", "r1", *codec.embeddings_to_parts("r1", embeds))
        assert msg.WhichOneof("location") == "shm" and t.name == "shm"
        assert msg.ByteSize() < 200  # the handle, not the bytes
        got = codec.embeddings_from_parts(*await recv.fetch_parts(_wire(msg)), "r1")
        assert all(torch.equal(a, b) for a, b in zip(got, embeds))
        assert all(not g.untyped_storage().resizable() for g in got)  # views of the mapping, not copies
        nbytes = sum(e.numel() * e.element_size() for e in embeds)
        assert senders.sent_bytes == {"shm": nbytes} and recv.received_bytes == {"shm": nbytes}
        senders.release(t, msg)  # prefill still reads it: left alone
        assert torch.equal(got[0], embeds[0])
        assert senders.held_bytes > 0
        del got
        gc.collect()
        assert senders.held_bytes == 0  # back once the receiver's last view died
        await senders.close()
        assert msg.shm.name not in os.listdir("/dev/shm")  # the slab goes with its sender
    asyncio.run(main())


def test_a_call_that_fails_before_prefill_takes_them_frees_the_region():
    async def main():
        senders = KVSenders(ME, _reach_of, byte_stream=False)
        msg, t = await senders.send_parts("local:1", "r2", *codec.embeddings_to_parts("r2", _embeds()))
        assert senders.held_bytes > 0
        senders.release(t, msg)  # encode's finally when the Prefill call failed
        assert senders.held_bytes == 0
        await senders.close()
    asyncio.run(main())


def test_another_host_gets_the_bytes_inline_and_a_forced_inline_everywhere():
    async def main():
        senders, recv = KVSenders(ME, _reach_of, byte_stream=False), embedding_receiver("cpu")
        msg, t = await senders.send_parts("remote:1", "r3", *codec.embeddings_to_parts("r3", _embeds()))
        assert msg.WhichOneof("location") == "inline" and t.name == "inline"
        assert senders.choices["remote:1"] == ("inline", "another host: inline in the message")
        got = codec.embeddings_from_parts(*await recv.fetch_parts(_wire(msg)), "r3")
        assert torch.equal(got[1], _embeds()[1])
        assert set(recv.received_bytes) == {"inline"}
        forced = KVSenders(ME, _reach_of, kind="inline", byte_stream=False)
        assert (await forced.transport_for("local:1")).name == "inline"
        await senders.close()
        await forced.close()
    asyncio.run(main())


def test_an_embeddings_payload_is_checked():
    header, tensors = codec.embeddings_to_parts("r4", _embeds())
    assert len(codec.embeddings_from_parts(header, tensors, "r4")) == 2
    with pytest.raises(CodecError, match="for request 'r4', not 'other'"):
        codec.embeddings_from_parts(header, tensors, "other")
    kv_header = codec.make_header(codec.KIND_KV, {"request_id": "r4"}, tensors)
    with pytest.raises(CodecError, match="expected an 'embeddings' payload"):
        codec.embeddings_from_parts(kv_header, tensors, "r4")


def test_a_prefill_with_a_rendezvous_takes_them_over_a_pair_group():
    """Between GPUs without shared memory the pair is NCCL; with a CPU end the same pair group
    runs over gloo, which is what runs here. The prefill advertises its store like decode."""
    async def main():
        recv = embedding_receiver("cpu", "127.0.0.1:0")
        prefill = NodeIdentity("h2", "cpu", kv_rendezvous=recv.transports["nccl"].address)

        async def reach_of(addr):
            return prefill, False

        senders = KVSenders(NodeIdentity("h1", "cpu"), reach_of, kind="nccl", byte_stream=False)
        embeds = _embeds()
        msg, t = await senders.send_parts("p:1", "r5", *codec.embeddings_to_parts("r5", embeds))
        assert msg.WhichOneof("location") == "nccl"
        got = codec.embeddings_from_parts(*await recv.fetch_parts(_wire(msg), timeout=20), "r5")
        assert all(torch.equal(a, b) for a, b in zip(got, embeds))
        assert senders.sent_bytes == recv.received_bytes == {"nccl": sum(e.numel() * e.element_size() for e in embeds)}
        await senders.close()
        await recv.transports["nccl"].close()
    asyncio.run(main())
