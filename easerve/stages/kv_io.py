"""KV handoff between prefill and decode through a transport, as KVTransfer messages.

`KVSender.send(payload) -> KVTransfer` on the prefill side; `KVReceiver.fetch(msg) ->
KVPayload` on the decode side. The transport moves the codec parts (typed header +
raw tensors); the message carries only its handle (or the bytes, for inline).
"""
from __future__ import annotations

from easerve.codec import kv_from_parts, kv_to_parts
from easerve.rpc.errors import InvalidRequest
from easerve.transport.base import KVTransport, handle_from_proto, handle_to_proto
from easerve.transport.inline import InlineTransport
from easerve.types import KVPayload
from easerve.v1 import kv_pb2


class KVSender:
    def __init__(self, transport: KVTransport | None = None):
        self.transport = transport or InlineTransport()

    @property
    def name(self) -> str:
        return self.transport.name

    async def send(self, payload: KVPayload, timeout: float | None = None) -> kv_pb2.KVTransfer:
        header, tensors = kv_to_parts(payload)
        handle = await self.transport.send(payload.request_id, header, tensors, timeout=timeout)
        return handle_to_proto(handle)

    def release(self, msg: kv_pb2.KVTransfer) -> None:
        """Free sender-side resources once decode has taken the payload (or gave up)."""
        self.transport.release(handle_from_proto(msg))


class KVReceiver:
    def __init__(self, transports: dict[str, KVTransport] | None = None):
        self.transports = {"inline": InlineTransport(), **(transports or {})}

    async def fetch(self, msg: kv_pb2.KVTransfer, timeout: float | None = None) -> KVPayload:
        where = msg.WhichOneof("location")
        if where is None:
            raise InvalidRequest("DecodeRequest.kv carries no payload; set inline bytes or a transport handle")
        transport = self.transports.get(where)
        if transport is None:
            raise InvalidRequest(f"this decode worker cannot receive KV over {where!r}; "
                                 f"it takes: {', '.join(self.transports)}")
        header, tensors = await transport.recv(handle_from_proto(msg), timeout=timeout)
        return kv_from_parts(header, tensors)
