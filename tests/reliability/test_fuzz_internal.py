"""Fuzzing the internal stage APIs of a live stack (encode, prefill, two decode instances and
decode's KVStream) over generic gRPC calls with identity serializers: unparseable / mutated
request bytes for every method, and well-formed protobufs whose tensors lie (dtype or shape
inconsistent with the byte length, negative or huge dims, unknown dtypes) or whose KV payloads
and handles are broken. Each must end INVALID_ARGUMENT (NOT_FOUND for a handle to something
that is not there) with a message; every stage keeps serving: same pids, no restarts, SERVING,
and a request through the gateway succeeds afterwards.

    EASERVE_TINY_CACHE=/tmp/tiny pytest -q -m slow tests/reliability/test_fuzz_internal.py -s
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from easerve import Client
from easerve.wire import codec
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import decode_pb2, encode_pb2, kv_pb2, prefill_pb2, stage_pb2
from tests.support.media import png_bytes
from tests.reliability.fuzz_cases import fuzz, Tally

pytestmark = [pytest.mark.slow, pytest.mark.load]  # hundreds of requests: a long load test
TALLY = Tally()
BAD = grpc.StatusCode.INVALID_ARGUMENT
HIDDEN = 64  # any width: a lying header is refused before the model sees it

# stage -> method -> (request type, request streaming, response streaming)
METHODS = {
    "encode": {"/easerve.v1.Encode/Encode": (encode_pb2.EncodeRequest, False, True),
               "/easerve.v1.Encode/Holds": (encode_pb2.HoldsRequest, False, False)},
    "prefill": {"/easerve.v1.Prefill/Prefill": (prefill_pb2.PrefillRequest, False, True)},
    "decode": {"/easerve.v1.Decode/Open": (decode_pb2.ReserveRequest, False, True),
               "/easerve.v1.Decode/Submit": (decode_pb2.DecodeRequest, False, False),
               "/easerve.v1.Decode/Stats": (decode_pb2.StatsRequest, False, False),
               "/easerve.v1.Decode/Cancel": (decode_pb2.CancelRequest, False, False),
               "/easerve.v1.KVStream/Push": (kv_pb2.KVChunk, True, False),
               "/easerve.v1.Stage/Load": (stage_pb2.LoadRequest, False, False)},
}


class Stages:
    def __init__(self, stack):
        self.stack, self.pids = stack, dict(stack.pids)
        eps = stack.endpoints.stages
        self.addr = {"encode": eps["encode-0"], "prefill": eps["prefill-0"], "decode": eps["decode-0"],
                     "decode-1": eps["decode-1"]}
        self.channels = {k: grpc.insecure_channel(a) for k, a in self.addr.items()}

    def call(self, stage: str, method: str, raw):
        """Send raw request bytes (a list of them for a streamed request); the response messages."""
        _, req_stream, resp_stream = METHODS[stage.split("-")[0]][method]
        ch = self.channels[stage]
        kind = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                (True, False): ch.stream_unary, (True, True): ch.stream_stream}[(req_stream, resp_stream)]
        fn = kind(method)
        out = fn(iter(raw) if req_stream else raw, timeout=30)
        return list(out) if resp_stream else [out]

    def refused(self, family: str, stage: str, method: str, raw, codes=(BAD,)) -> None:
        if hasattr(raw, "SerializeToString"):
            raw = raw.SerializeToString()
        try:
            got = self.call(stage, method, raw)
        except grpc.RpcError as e:
            TALLY.add(family, e.code().name)
            assert e.code() in codes, f"{family} {stage}{method}: {e.code()} {e.details()}"
            assert e.details() and e.details().strip()
            return
        TALLY.add(family, "OK")
        raise AssertionError(f"{family} {stage}{method}: accepted ({len(got)} messages)")

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


@pytest.fixture(scope="module")
def stages(fuzz_vl):
    s = Stages(fuzz_vl)
    yield s
    s.close()


def meta(rid: str = "fuzz-1") -> cpb.RequestMeta:
    return cpb.RequestMeta(request_id=rid, deadline_ms=5000)


# ---- unparseable and mutated bytes, every method --------------------------------------------
def _fails(cls, raw: bytes) -> bool:
    try:
        cls.FromString(raw)
    except Exception:  # noqa: BLE001 - only bytes protobuf itself refuses are wanted
        return True
    return False


SAMPLES = {  # a valid request of each type, to mutate
    encode_pb2.EncodeRequest: encode_pb2.EncodeRequest(meta=meta(), input_ids=[1, 2, 3]),
    encode_pb2.HoldsRequest: encode_pb2.HoldsRequest(content_hashes=[b"\x01" * 32]),
    prefill_pb2.PrefillRequest: prefill_pb2.PrefillRequest(meta=meta(), input_ids=[1, 2]),
    decode_pb2.ReserveRequest: decode_pb2.ReserveRequest(meta=meta(), num_tokens=3, max_new_tokens=2),
    decode_pb2.DecodeRequest: decode_pb2.DecodeRequest(meta=meta(), kv=kv_pb2.KVTransfer(inline=b"abc")),
    decode_pb2.StatsRequest: None, decode_pb2.CancelRequest: decode_pb2.CancelRequest(request_id="x"),
    kv_pb2.KVChunk: kv_pb2.KVChunk(key="k", total_bytes=3, data=b"abc"),
    stage_pb2.LoadRequest: None,
}
ALL = [(stage, m) for stage, ms in METHODS.items() for m in ms]


def _mutate(args):
    (stage, method), cut, flips, junk = args
    cls = METHODS[stage][method][0]
    base = SAMPLES[cls].SerializeToString() if SAMPLES[cls] is not None else b""
    raw = bytearray(base[:cut % (len(base) + 1)] if base else b"")
    for at, b in flips:
        if raw:
            raw[at % len(raw)] = b
    return stage, method, bytes(raw) + junk


garbage = st.tuples(st.sampled_from(ALL), st.integers(0, 200),
                    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
                    st.binary(max_size=24)).map(_mutate).filter(
    lambda c: _fails(METHODS[c[0]][c[1]][0], c[2]))


@fuzz(200)
@given(garbage)
def test_unparseable_bytes_every_method(stages, case):
    stage, method, raw = case
    req_stream = METHODS[stage][method][1]
    stages.refused("unparseable protobuf", stage, method, [raw] if req_stream else raw)


# ---- tensors whose headers lie ------------------------------------------------------------------
DTYPES = ["float32", "bfloat16", "int64", "uint8", "bool"]


def _lying_tensor(args) -> cpb.TensorProto:
    kind, dtype, dims, extra = args
    itemsize = codec.DTYPES[dtype].itemsize
    n = int(np.prod(dims)) if dims else 1
    if kind == "short":      # fewer bytes than dtype x shape needs
        return cpb.TensorProto(dtype=dtype, shape=dims, data=bytes(max(0, n * itemsize - 1 - extra % 7)))
    if kind == "long":       # more bytes than it needs
        return cpb.TensorProto(dtype=dtype, shape=dims, data=bytes(n * itemsize + 1 + extra))
    if kind == "negative":
        return cpb.TensorProto(dtype=dtype, shape=[*dims, -1 - extra], data=bytes(itemsize))
    if kind == "huge":       # a shape whose size no message could carry
        return cpb.TensorProto(dtype=dtype, shape=[2 ** 40 + extra, 2 ** 30], data=bytes(itemsize * 4))
    if kind == "dtype":
        return cpb.TensorProto(dtype=["float8", "complex64", "", "FLOAT32", "int4"][extra % 5], shape=dims,
                               data=bytes(n * 4))
    return cpb.TensorProto(dtype=dtype, shape=[2 ** 63 - 1, 2 ** 63 - 1], data=b"")  # size overflows int64


lying_tensor = st.tuples(st.sampled_from(["short", "long", "negative", "huge", "dtype", "overflow"]),
                         st.sampled_from(DTYPES), st.lists(st.integers(1, 6), min_size=1, max_size=3),
                         st.integers(0, 50)).map(_lying_tensor)
IMAGE_IDS = [151652, 151655, 151655, 151653]  # any ids: the item is refused before its placeholders are


@fuzz(80)
@given(lying_tensor, st.sampled_from(["pixels", "meta"]))
def test_encode_with_lying_tensors(stages, t, where):
    good = cpb.TensorProto(dtype="int64", shape=[1, 3], data=np.array([[1, 2, 2]], "<i8").tobytes())
    info = cpb.ItemMeta(modality="image", num_tokens=1, meta={"image_grid_thw": t if where == "meta" else good})
    item = encode_pb2.MediaItem(info=info, inputs={"pixel_values": t} if where == "pixels" else
                                {"pixel_values": cpb.TensorProto(dtype="float32", shape=[4, 4], data=bytes(64))})
    req = encode_pb2.EncodeRequest(meta=meta(), input_ids=IMAGE_IDS, items=[item],
                                   sampling=cpb.SamplingParams(max_tokens=2),
                                   decode=cpb.DecodeTarget(address=stages.addr["decode"]))
    stages.refused("lying tensor headers", "encode", "/easerve.v1.Encode/Encode", req)


@fuzz(80)
@given(lying_tensor, st.sampled_from(["embeddings", "meta"]))
def test_prefill_with_lying_tensors(stages, t, where):
    good = cpb.TensorProto(dtype="float32", shape=[1, HIDDEN], data=bytes(4 * HIDDEN))
    info = cpb.ItemMeta(modality="image", num_tokens=1, meta={"image_grid_thw": t} if where == "meta" else {})
    req = prefill_pb2.PrefillRequest(meta=meta(), input_ids=[1, 2, 3], items=[info],
                                     embeddings=prefill_pb2.Embeddings(tensors=[t if where == "embeddings" else good]),
                                     sampling=cpb.SamplingParams(max_tokens=2),
                                     decode=cpb.DecodeTarget(address=stages.addr["decode"]))
    stages.refused("lying tensor headers", "prefill", "/easerve.v1.Prefill/Prefill", req)


# ---- KV payloads and handles at decode ------------------------------------------------------------
def kv_frame(num_layers: int = 2, tokens: int = 3) -> tuple[bytes, list[torch.Tensor]]:
    keys = [torch.zeros(2, tokens, 8) for _ in range(num_layers)]
    p = KVPayload(request_id="fuzz-1", keys=keys, values=[k.clone() for k in keys], prompt_len=tokens,
                  rope_delta=0, first_token=1, sampling=SamplingParams(max_tokens=2), prompt_ids_tail=[1])
    return codec.kv_to_parts(p)


def _bad_kv(args) -> bytes:
    kind, n = args
    header, tensors = kv_frame()
    if kind == "random":
        return np.random.default_rng(n).bytes(n % 200)
    frame = bytearray(codec.join_parts(header, tensors))
    if kind == "truncated":
        return bytes(frame[: n % (len(frame) - 1)])
    if kind == "trailing":
        return bytes(frame) + b"\x00" * (1 + n % 64)
    if kind == "magic":
        return b"PKL!" + bytes(frame[4:])
    if kind == "header_len":  # a header length past the frame
        frame[8:12] = (len(frame) + 1 + n).to_bytes(4, "little")
        return bytes(frame)
    obj = __import__("json").loads(header)
    spec = obj["tensors"][n % len(obj["tensors"])]
    if kind == "shape":       # shape inconsistent with the bytes that follow
        spec["shape"] = [spec["shape"][0], spec["shape"][1], spec["shape"][2] + 1 + n % 5]
    elif kind == "negative":
        spec["shape"] = [2, -3, 8]
    elif kind == "huge":
        spec["shape"] = [2 ** 40, 2 ** 40, 8]
    elif kind == "dtype":
        spec["dtype"] = ["int64", "float16", "pickle", "object"][n % 4]
    elif kind == "layers":
        obj["meta"]["num_layers"] = 3 + n % 4
    elif kind == "meta":
        obj["meta"][["num_tokens", "prompt_len", "first_token", "request_id"][n % 4]] = "x" if n % 2 else None
    elif kind == "sampling":
        obj["meta"]["sampling"] = {"max_tokens": -1 - n} if n % 2 else {"evil": 1}
    bad = __import__("json").dumps(obj).encode()
    return codec._PREAMBLE.pack(codec.MAGIC, codec.VERSION, 0, len(bad)) + bad  # tensors as the header says: absent


bad_kv = st.tuples(st.sampled_from(["random", "truncated", "trailing", "magic", "header_len", "shape", "negative",
                                    "huge", "dtype", "layers", "meta", "sampling"]), st.integers(0, 1000)).map(_bad_kv)


@fuzz(80)
@given(bad_kv, st.sampled_from(["decode", "decode-1"]))
def test_decode_submit_bad_kv(stages, raw, which):
    req = decode_pb2.DecodeRequest(meta=meta(), kv=kv_pb2.KVTransfer(request_id="fuzz-1", nbytes=len(raw), inline=raw))
    stages.refused("broken KV payloads", which, "/easerve.v1.Decode/Submit", req)


SHM_HANDLES = [kv_pb2.ShmSegment(name=n, offset=o, size=s, slab=slab)
               for n, o, s, slab in [("", 0, 10, False), ("a/b", 0, 10, False), ("../../etc/passwd", 0, 1, False),
                                     ("x\x00y", 0, 1, False), ("easerve-nope", 0, 10, False),
                                     ("easerve-nope", 2 ** 63, 2 ** 63, False), ("easerve-slab-nope", 64, 10, True),
                                     ("n" * 300, 0, 1, False), ("easerve-x", 0, 0, False)]]


@fuzz(30)
@given(st.sampled_from(SHM_HANDLES), st.sampled_from(["decode", "decode-1"]))
def test_decode_submit_bad_shm_handles(stages, seg, which):
    req = decode_pb2.DecodeRequest(meta=meta(), kv=kv_pb2.KVTransfer(request_id="fuzz-1", nbytes=seg.size, shm=seg))
    stages.refused("broken KV handles", which, "/easerve.v1.Decode/Submit", req, codes=(BAD, grpc.StatusCode.NOT_FOUND))


def _push(args) -> list[bytes]:
    kind, n = args
    if kind == "no_key":
        return [kv_pb2.KVChunk(total_bytes=4, data=b"abcd").SerializeToString()]
    if kind == "overflow":
        return [kv_pb2.KVChunk(key=f"k{n}", total_bytes=4, data=b"abc").SerializeToString(),
                kv_pb2.KVChunk(data=b"x" * (2 + n % 100)).SerializeToString()]
    if kind == "short":
        return [kv_pb2.KVChunk(key=f"k{n}", total_bytes=100 + n, data=b"abc").SerializeToString()]
    if kind == "huge":
        return [kv_pb2.KVChunk(key=f"k{n}", total_bytes=2 ** 40 + n, data=b"abc").SerializeToString()]
    if kind == "empty":
        return []
    return [kv_pb2.KVChunk(key="k", total_bytes=4, data=b"ab").SerializeToString(), b"\x0a\xff" + bytes([n % 256])]


@fuzz(40)
@given(st.tuples(st.sampled_from(["no_key", "overflow", "short", "huge", "empty", "garbage"]), st.integers(0, 500)).map(_push))
def test_kv_stream_bad_pushes(stages, chunks):
    stages.refused("broken KV streams", "decode", "/easerve.v1.KVStream/Push", chunks)


RESERVES = [decode_pb2.ReserveRequest(), decode_pb2.ReserveRequest(meta=meta(), num_tokens=0, max_new_tokens=2),
            decode_pb2.ReserveRequest(meta=meta(), num_tokens=3, max_new_tokens=0),
            decode_pb2.ReserveRequest(meta=meta(), num_tokens=2 ** 32 - 1, max_new_tokens=2 ** 32 - 1)]


@fuzz(10)
@given(st.sampled_from(RESERVES))
def test_decode_open_bad_reservations(stages, req):
    stages.refused("bad reservations", "decode", "/easerve.v1.Decode/Open", req)


# ---- afterwards ---------------------------------------------------------------------------------
def test_zz_every_stage_still_serving(stages):
    for name in stages.stack.endpoints.stages:
        assert stages.stack.healthy(name), name
    out = Client(stages.stack.endpoints.grpc, timeout=120).generate(prompt="What is this?",
                                                                   images=[png_bytes(32, 32, 2)], max_tokens=3)
    assert len(out.token_ids) >= 1
    assert stages.stack.pids == stages.pids and set(stages.stack.restarts.values()) == {0}
    print(f"\ninternal-API fuzz, requests and statuses per family:\n{TALLY.table()}")
    assert TALLY.total >= 500
