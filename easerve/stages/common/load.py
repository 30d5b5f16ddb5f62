"""`easerve.v1.Stage`, served by every stage process: how much it holds and where it lives
(Load: callers place work by load and pick transports), and whether it can read a
sender's shared-memory probe (ShmProbe)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from easerve.rpc.errors import grpc_errors
from easerve.stages.common.pace import Pace
from easerve.transport.node import NodeIdentity, read_probe
from easerve.wire.v1 import stage_pb2, stage_pb2_grpc


@dataclass(frozen=True)
class Load:
    inflight: int
    max_inflight: int
    queued: int = 0
    kv_free_tokens: int = 0
    kv_total_tokens: int = 0
    pace: Pace | None = None  # easerve/stages/common/pace.py; None: the stage does not say
    busy_s: float = 0.0  # seconds computed so far (a counter)
    overdue: int = 0  # of `queued`, those the deadline order puts last (yielding or past their deadline)


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, stage: str, node: NodeIdentity, load: Callable[[], Awaitable[Load]]):
        self.stage, self.node, self._load = stage, node, load

    @grpc_errors
    async def Load(self, request, context):
        ld = await self._load()
        msg = stage_pb2.LoadResponse(stage=self.stage, inflight=ld.inflight, max_inflight=ld.max_inflight,
                                     queued=ld.queued, kv_free_tokens=ld.kv_free_tokens,
                                     kv_total_tokens=ld.kv_total_tokens, busy_s=ld.busy_s,
                                     overdue=ld.overdue)
        if ld.pace is not None:
            msg.recent_batch_s, msg.recent_batch_size = ld.pace.now()
        self.node.to_proto(msg.node)
        return msg

    @grpc_errors
    async def ShmProbe(self, request, context):
        return stage_pb2.ShmProbeResponse(readable=read_probe(request.name) == request.token != "")


def adder(servicer: StageServicer):
    return (stage_pb2_grpc.add_StageServicer_to_server, servicer)
