"""CUDA IPC on CPU: the receiver maps the handle's GPU by UUID onto its own numbering, the
UUID survives the wire, and the ready event goes on the stream that wrote the KV."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from easerve.errors import InvalidRequest, Unavailable
from easerve.transport.cuda_ipc import local_index, record_ready
from easerve.transport.handles import CudaIpcHandle, CudaTensorRef, handle_from_proto, handle_to_proto


def test_receiver_maps_the_gpu_by_uuid_not_the_senders_index() -> None:
    # the sender ran with CUDA_VISIBLE_DEVICES=2,3 and wrote on its cuda:1 (GPU-d);
    # the receiver sees all four GPUs: the same GPU is its index 3
    assert local_index("GPU-d", ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == 3
    with pytest.raises(Unavailable, match="GPU-d of the CUDA IPC handle is not visible.*CUDA_VISIBLE_DEVICES"):
        local_index("GPU-d", ["GPU-a"])
    with pytest.raises(InvalidRequest, match="names no GPU UUID"):
        local_index("", ["GPU-a"])


def test_handle_carries_the_uuid_over_the_wire() -> None:
    ref = CudaTensorRef("float16", (2, 3), (3, 1), 0, 1, b"h", 12, 0, b"r", 0, b"", False)
    h = CudaIpcHandle("r1", b"hdr", (ref,), b"ev", 1, 12, "GPU-d")
    back = handle_from_proto(handle_to_proto(h))
    assert back == h and back.device_uuid == "GPU-d"


def test_ready_event_is_recorded_on_the_writer_stream() -> None:
    recorded = []

    class Event:
        def __init__(self, interprocess: bool) -> None:
            assert interprocess
        def record(self, stream) -> None:
            recorded.append(stream)

    cuda = NS(Event=Event, current_stream=lambda device=None: "default")
    record_ready(cuda, "prefill-green-stream")
    assert recorded == ["prefill-green-stream"]
