import ast
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from easerve.wire import codec, protoconv, sampling_proto
from easerve.errors import CodecError
from easerve.types import KVPayload, SamplingParams

KV_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_kv(layers=2, heads=2, tokens=3, dim=4, dtype=torch.float32, **kw) -> KVPayload:
    g = torch.Generator().manual_seed(0)
    mk = lambda: torch.randn(heads, tokens, dim, generator=g).to(dtype)  # noqa: E731
    fields = dict(request_id="req-1", keys=[mk() for _ in range(layers)],
                  values=[mk() for _ in range(layers)], prompt_len=tokens, rope_delta=-2,
                  first_token=7, sampling=SamplingParams(max_tokens=5, temperature=0.5, seed=3,
                                                         stop=("x",), stop_token_ids=(1, 2)),
                  prompt_ids_tail=[4, 5, 6])
    fields.update(kw)
    return KVPayload(**fields)


def frame(p: KVPayload) -> bytes:
    return codec.join_parts(*codec.kv_to_parts(p))


def unframe(buf, copy: bool = True) -> KVPayload:
    return codec.kv_from_parts(*codec.split_parts(buf, copy=copy))


def tensors_frame(meta: dict, ts: list) -> bytes:
    return codec.join_parts(codec.make_header("tensors", meta, ts), ts)


def tensors_unframe(buf) -> tuple[dict, list]:
    header, ts = codec.split_parts(buf)
    return codec.check_parts(header, ts)[1], ts


def assert_kv_equal(a: KVPayload, b: KVPayload) -> None:
    for f in ("request_id", "prompt_len", "rope_delta", "first_token", "sampling", "prompt_ids_tail"):
        assert getattr(a, f) == getattr(b, f), f
    assert len(a.keys) == len(b.keys) and len(a.values) == len(b.values)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(0, 3), heads=st.integers(1, 3), tokens=st.integers(0, 5),
       dim=st.integers(1, 9), dtype=st.sampled_from(KV_DTYPES), copy=st.booleans())
def test_kv_roundtrip(layers, heads, tokens, dim, dtype, copy):
    p = make_kv(layers, heads, tokens, dim, dtype)
    buf = frame(p)
    assert isinstance(buf, bytes)
    assert_kv_equal(unframe(buf, copy=copy), p)
    assert_kv_equal(codec.kv_from_parts(*codec.kv_to_parts(p)), p)


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted(codec.DTYPES)), shapes), max_size=4))
def test_tensors_roundtrip_any_dtype_and_shape(specs):
    ts = [(torch.rand(s) * 100).to(codec.DTYPES[d]) for d, s in specs]
    meta = {"items": [{"modality": "image", "n": len(ts)}]}
    got_meta, got = tensors_unframe(bytearray(tensors_frame(meta, ts)))
    assert got_meta == meta
    for x, y in zip(ts, got):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_noncontiguous_and_scalar_tensors():
    ts = [torch.arange(12.0).reshape(3, 4).t(), torch.tensor(2.5, dtype=torch.bfloat16)]
    _, got = tensors_unframe(tensors_frame({}, ts))
    assert torch.equal(got[0], ts[0]) and torch.equal(got[1], ts[1])


def test_tensor_data_is_aligned():
    buf = tensors_frame({"m": "x" * 7}, [torch.ones(3, dtype=torch.uint8), torch.ones(5)])
    header, _ = codec.split_parts(buf)
    offsets, total = codec.layout(len(header), codec.parse_header(header)[2])
    assert all(o % codec.ALIGN == 0 for o in offsets) and total == len(buf)


def test_truncation_at_every_cut_point_raises():
    buf = frame(make_kv(layers=2, heads=1, tokens=2, dim=3, dtype=torch.bfloat16))
    for cut in range(len(buf)):
        with pytest.raises(CodecError):
            unframe(buf[:cut])


def test_trailing_bytes_raise():
    with pytest.raises(CodecError, match="trailing"):
        unframe(frame(make_kv()) + b"\0")


def _tamper(buf: bytes, old: bytes, new: bytes) -> bytes:
    """Replace the first `old` in the header's tensor table with a same-length `new`."""
    assert len(old) == len(new)
    at = buf.index(old, buf.index(b'"tensors"')) if old != b'"kind":"kv"' else buf.index(old)
    return buf[:at] + new + buf[at + len(old):]


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"NOPE" + b[4:], "magic"),
    (lambda b: b[:4] + struct.pack("<H", 99) + b[6:], "version 99"),
    (lambda b: b[:6] + struct.pack("<H", 1) + b[8:], "flags"),
    (lambda b: b[:8] + struct.pack("<I", 1 << 30) + b[12:], "truncated"),
])
def test_bad_preamble(mutate, message):
    with pytest.raises(CodecError, match=message):
        unframe(mutate(frame(make_kv())))


def test_unknown_dtype_kind_and_shape_mismatch():
    buf = frame(make_kv(layers=1))
    with pytest.raises(CodecError, match="unknown dtype 'float99'"):
        unframe(_tamper(buf, b'"float32"', b'"float99"'))
    with pytest.raises(CodecError, match="truncated"):  # byte count no longer matches
        unframe(_tamper(buf, b"[2,3,4]", b"[9,3,4]"))
    with pytest.raises(CodecError, match="expected a 'kv' payload"):
        unframe(_tamper(buf, b'"kind":"kv"', b'"kind":"kk"'))


def test_kv_header_inconsistencies():
    header, ts = codec.kv_to_parts(make_kv(layers=2))
    with pytest.raises(CodecError, match="do not match"):
        codec.kv_from_parts(header, ts[:-1])
    with pytest.raises(CodecError, match="share one dtype"):
        codec.kv_to_parts(make_kv(layers=1, values=[torch.zeros(2, 3, 4, dtype=torch.float16)]))
    with pytest.raises(CodecError, match="must share one dtype"):
        codec.kv_to_parts(make_kv(layers=1, dtype=torch.int32))
    with pytest.raises(CodecError, match="not UTF-8 JSON"):
        codec.kv_from_parts(b"\xff{", ts)


def test_parts_header_must_match_tensors():
    header = codec.make_header("tensors", {"a": 1}, [torch.zeros(2)])
    with pytest.raises(CodecError, match="do not match"):
        codec.join_parts(header, [torch.zeros(3)])


def test_write_parts_into_buffer():
    ts = [torch.arange(10, dtype=torch.int64)]
    header = codec.make_header("tensors", {}, ts)
    buf = bytearray(codec.frame_size(header))
    n = codec.write_parts(header, ts, memoryview(buf))
    assert n == len(buf) and bytes(buf) == codec.join_parts(header, ts)
    with pytest.raises(CodecError, match="too small"):
        codec.write_parts(header, ts, memoryview(bytearray(10)))


def test_tensor_proto_roundtrip_and_errors():
    t = torch.randn(2, 3).to(torch.bfloat16)
    msg = protoconv.tensor_to_proto(t)
    assert msg.dtype == "bfloat16" and list(msg.shape) == [2, 3]
    assert torch.equal(protoconv.tensor_from_proto(msg), t)
    msg.data = msg.data[:-1]
    with pytest.raises(CodecError, match="needs 12 bytes, has 11"):
        protoconv.tensor_from_proto(msg)
    msg.dtype = "str"
    with pytest.raises(CodecError, match="unknown dtype"):
        protoconv.tensor_from_proto(msg)


def test_sampling_proto_roundtrip():
    sp = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=11,
                        stop=("a", "bc"), stop_token_ids=(3,), ignore_eos=True)
    assert sampling_proto.sampling_from_proto(sampling_proto.sampling_to_proto(sp)) == sp
    from easerve.wire.v1 import common_pb2
    assert sampling_proto.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError):
        sampling_proto.sampling_from_proto(common_pb2.SamplingParams(temperature=-1))


def test_no_pickle_or_torch_load_in_module():
    tree = ast.parse(Path(codec.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"pickle", "cPickle", "dill", "cloudpickle"} & names
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "torch.load" not in calls and "pickle.loads" not in calls
