"""The prefill's decode target: none named is the caller's error (INVALID_ARGUMENT); one this
prefill does not have is an instance drained or removed after the caller chose it, so
UNAVAILABLE, which the caller retries elsewhere (the chaos soak lost 3 requests as HTTP 400
when a drained decode was still chosen)."""
from __future__ import annotations

import asyncio

import pytest

from easerve.errors import InvalidRequest, Unavailable
from easerve.stages.common.peers import Peers
from easerve.stages.prefill.stage import PrefillStage
from easerve.wire.v1 import decode_pb2_grpc


def test_an_unknown_decode_target_is_unavailable_and_a_missing_one_invalid():
    async def main():
        decode = Peers(decode_pb2_grpc.DecodeStub, ["127.0.0.1:1"], service="easerve.v1.Decode")
        stage = PrefillStage(None, decode, None, (), None)
        assert (await stage._target("127.0.0.1:1")).addr == "127.0.0.1:1"
        with pytest.raises(Unavailable, match="drained or removed"):
            await stage._target("127.0.0.1:2")
        with pytest.raises(InvalidRequest, match="names no decode target"):
            await stage._target("")
        await decode.close()
    asyncio.run(main())
