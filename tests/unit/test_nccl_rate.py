"""The NCCL transport measures GB/s once the transfer has finished on the device, not when
the sends were queued: `completed` (CUDA: a stream synchronize) runs before the clock stops."""
from __future__ import annotations

import asyncio
import time

import torch

from easerve.wire import codec
from easerve.transport.nccl import NcclConfig, NcclTransport


class QueuingComm:
    """torch.distributed's send as NCCL does it: queued, returns at once."""

    def __init__(self) -> None:
        self.queued: list[int] = []

    def send(self, tensor, dst: int) -> None:
        self.queued.append(tensor.numel() * tensor.element_size())

    def is_initialized(self) -> bool:
        return False


def test_rate_is_measured_after_the_transfer_completes() -> None:
    comm, finished = QueuingComm(), []
    wire_s = 0.2  # what the queued transfer takes on the device

    def completed() -> None:
        time.sleep(wire_s)
        finished.append(sum(comm.queued))

    t = NcclTransport(NcclConfig(rank=0, init_method="tcp://127.0.0.1:1", backend="gloo", device="cpu"),
                      comm=comm, completed=completed)
    keys = [torch.ones(4, 1024, dtype=torch.float16)]
    header, tensors = codec.kv_to_parts(_payload(keys))

    async def main():
        h = await t.send("r", header, tensors)
        await t.close()
        return h
    h = asyncio.run(main())
    assert finished and finished[0] >= h.nbytes
    assert t.last_gbps <= h.nbytes / wire_s / 1e9  # the wait is inside the measured time


def _payload(keys):
    from easerve.types import KVPayload, SamplingParams
    return KVPayload("r", keys, keys, 4, 0, 1, SamplingParams(max_tokens=4))
