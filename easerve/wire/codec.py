"""Wire format for tensors crossing processes: a typed JSON header + raw tensor bytes.

Frame (version 1), all integers little-endian:

    b"EASV" | u16 version | u16 flags (0) | u32 header_len | header (UTF-8 JSON)
    | tensor 0 bytes | tensor 1 bytes | ...      (each tensor starts at a multiple of 64)

The header is self-describing: {"kind": ..., "tensors": [{"dtype", "shape"}, ...], "meta": {...}}.
The same header is the "parts" form `(header, tensors)` that transports move when they do
not go through bytes (CUDA IPC, NCCL). Nothing here uses pickle or torch.load: tensors are
rebuilt with torch.frombuffer from the declared dtype and shape, and every length is checked.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from easerve.errors import CodecError
from easerve.types import KVPayload, SamplingParams

MAGIC = b"EASV"
VERSION = 1
ALIGN = 64
_PREAMBLE = struct.Struct("<4sHHI")
MAX_HEADER_BYTES = 16 << 20
KIND_KV = "kv"
KIND_EMBEDDINGS = "embeddings"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
KV_DTYPES = ("bfloat16", "float16", "float32")
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise CodecError(f"unsupported dtype {dtype}; supported: {sorted(DTYPES)}")
    return _NAMES[dtype]


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(dtype_name(t.dtype), tuple(int(d) for d in t.shape))


# ---------------------------------------------------------------- header and frame
def make_header(kind: str, meta: dict[str, Any], tensors: Sequence[torch.Tensor]) -> bytes:
    specs = [{"dtype": s.dtype, "shape": list(s.shape)} for s in map(spec_of, tensors)]
    obj = {"kind": kind, "tensors": specs, "meta": meta}
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def parse_header(header: bytes) -> tuple[str, dict[str, Any], list[TensorSpec]]:
    """(kind, meta, tensor specs) of a parts header; CodecError if it is not one."""
    try:
        obj = json.loads(bytes(header).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise CodecError("header must be a JSON object with a string 'kind'")
    if not isinstance(obj.get("meta"), dict) or not isinstance(obj.get("tensors"), list):
        raise CodecError("header needs an object 'meta' and a list 'tensors'")
    return obj["kind"], obj["meta"], [parse_spec(i, s) for i, s in enumerate(obj["tensors"])]


def parse_spec(i: int, s: Any) -> TensorSpec:
    """Tensor `i`'s spec from its header entry {'dtype', 'shape'}; CodecError saying what is wrong."""
    if not isinstance(s, dict) or set(s) != {"dtype", "shape"}:
        raise CodecError(f"tensor {i}: spec must be {{'dtype', 'shape'}}, got {s!r}")
    if s["dtype"] not in DTYPES:
        raise CodecError(f"tensor {i}: unknown dtype {s['dtype']!r}; supported: {sorted(DTYPES)}")
    shape = s["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"tensor {i}: shape must be a list of ints >= 0, got {shape!r}")
    return TensorSpec(s["dtype"], tuple(shape))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(header_len: int, specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a frame, and the frame's total size."""
    pos, offsets = _PREAMBLE.size + header_len, []
    for s in specs:
        pos = _align(pos)
        offsets.append(pos)
        pos += s.nbytes
    return offsets, pos


def check_parts(header: bytes, tensors: Sequence[torch.Tensor]) -> tuple[str, dict, list[TensorSpec]]:
    kind, meta, specs = parse_header(header)
    got = [spec_of(t) for t in tensors]
    if got != specs:
        raise CodecError(f"tensors {got} do not match the header's {specs}")
    return kind, meta, specs


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat CPU uint8 tensor (little-endian hosts only)."""
    if sys.byteorder != "little":
        raise CodecError("the codec writes little-endian data; big-endian hosts are unsupported")
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def frame_size(header: bytes) -> int:
    return layout(len(header), parse_header(header)[2])[1]


def write_parts(header: bytes, tensors: Sequence[torch.Tensor], buf: memoryview) -> int:
    """Write the frame of (header, tensors) into a writable buffer; return its size."""
    specs = check_parts(header, tensors)[2]
    offsets, total = layout(len(header), specs)
    if len(buf) < total:
        raise CodecError(f"buffer of {len(buf)} bytes is too small for a {total}-byte frame")
    buf[: _PREAMBLE.size] = _PREAMBLE.pack(MAGIC, VERSION, 0, len(header))
    buf[_PREAMBLE.size: _PREAMBLE.size + len(header)] = header
    for t, off, s in zip(tensors, offsets, specs):
        if s.nbytes:
            torch.frombuffer(buf, dtype=torch.uint8, count=s.nbytes, offset=off).copy_(raw_bytes(t))
    return total


def iter_frame(header: bytes, tensors: Sequence[torch.Tensor]) -> Iterator[memoryview]:
    """The frame of (header, tensors) as consecutive byte views (no copy of tensor data)."""
    specs = check_parts(header, tensors)[2]
    offsets, _ = layout(len(header), specs)
    yield memoryview(_PREAMBLE.pack(MAGIC, VERSION, 0, len(header)) + header)
    pos = _PREAMBLE.size + len(header)
    for t, off, s in zip(tensors, offsets, specs):
        if off > pos:
            yield memoryview(bytes(off - pos))
        if s.nbytes:
            yield memoryview(raw_bytes(t).numpy())
        pos = off + s.nbytes


def join_parts(header: bytes, tensors: Sequence[torch.Tensor]) -> bytes:
    """The frame of (header, tensors) as bytes (one copy of the tensor data)."""
    return b"".join(iter_frame(header, tensors))


def split_parts(buf: Any, *, copy: bool = True) -> tuple[bytes, list[torch.Tensor]]:
    """Parse a frame. copy=False returns views into `buf` (keep it alive, do not mutate it)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREAMBLE.size:
        raise CodecError(f"truncated: {len(mv)} bytes, the preamble alone is {_PREAMBLE.size}")
    magic, version, flags, hlen = _PREAMBLE.unpack_from(mv)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}: not an easerve codec payload (want {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"unknown codec version {version}; this build reads version {VERSION}")
    if flags != 0:
        raise CodecError(f"unknown flags {flags:#x} for codec version {VERSION}")
    if hlen > MAX_HEADER_BYTES or _PREAMBLE.size + hlen > len(mv):
        raise CodecError(f"truncated: header of {hlen} bytes declared, {len(mv) - _PREAMBLE.size} present")
    header = bytes(mv[_PREAMBLE.size: _PREAMBLE.size + hlen])
    specs = parse_header(header)[2]
    offsets, total = layout(hlen, specs)
    if len(mv) != total:
        what = "truncated" if len(mv) < total else "trailing bytes"
        raise CodecError(f"{what}: header declares a {total}-byte payload, got {len(mv)} bytes")
    return header, [view_tensor(mv, s, off, copy) for s, off in zip(specs, offsets)]


def view_tensor(mv: memoryview, s: TensorSpec, off: int, copy: bool) -> torch.Tensor:
    """The tensor of spec `s` at byte `off` of `mv`: a copy, or (copy=False) a view into `mv`."""
    dtype = DTYPES[s.dtype]
    if s.numel == 0:
        return torch.empty(s.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(mv, dtype=dtype, count=s.numel, offset=off).reshape(s.shape)
    return t.clone() if copy else t


# ---------------------------------------------------------------- sampling params
def sampling_to_dict(sp: SamplingParams) -> dict[str, Any]:
    return {k: _lists(v) for k, v in dataclasses.asdict(sp).items()}


def _lists(v: Any) -> Any:
    return [_lists(x) for x in v] if isinstance(v, tuple) else v


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def sampling_from_dict(d: Any) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    if not isinstance(d, dict) or not set(d) <= names:
        raise CodecError(f"sampling must be an object with keys from {sorted(names)}, got {d!r}")
    try:
        return SamplingParams(**{k: _tuples(v) for k, v in d.items()})
    except (TypeError, ValueError) as e:
        raise CodecError(f"bad sampling params: {e}") from None


# ---------------------------------------------------------------- KV payload
_KV_INTS = ("num_layers", "num_tokens", "prompt_len", "rope_delta", "first_token")


def kv_to_parts(p: KVPayload) -> tuple[bytes, list[torch.Tensor]]:
    """Header + tensors [k0, v0, k1, v1, ...] (left on their device)."""
    if len(p.keys) != len(p.values):
        raise CodecError(f"{len(p.keys)} key tensors but {len(p.values)} value tensors")
    tensors = [t for kv in zip(p.keys, p.values) for t in kv]
    dtypes = {dtype_name(t.dtype) for t in tensors} or {KV_DTYPES[0]}
    if len(dtypes) != 1 or not dtypes <= set(KV_DTYPES):
        raise CodecError(f"KV tensors must share one dtype of {KV_DTYPES}, got {sorted(dtypes)}")
    meta = {"request_id": p.request_id, "dtype": dtypes.pop(), "num_layers": p.num_layers,
            "num_tokens": p.num_tokens, "prompt_len": p.prompt_len, "rope_delta": p.rope_delta,
            "first_token": p.first_token, "sampling": sampling_to_dict(p.sampling),
            "prompt_ids_tail": list(p.prompt_ids_tail), "penalty_ids": list(p.penalty_ids)}
    if p.first_tokens:
        meta["first_tokens"] = list(p.first_tokens)
    return make_header(KIND_KV, meta, tensors), tensors


def kv_from_parts(header: bytes, tensors: Sequence[torch.Tensor]) -> KVPayload:
    kind, m, specs = check_parts(header, tensors)
    if kind != KIND_KV:
        raise CodecError(f"expected a '{KIND_KV}' payload, got '{kind}'")
    for k in _KV_INTS:
        if type(m.get(k)) is not int:
            raise CodecError(f"KV header field {k!r} must be an int, got {m.get(k)!r}")
    if not isinstance(m.get("request_id"), str) or m.get("dtype") not in KV_DTYPES:
        raise CodecError(f"KV header needs a string request_id and a dtype of {KV_DTYPES}")
    tail, penalty_ids, firsts = m.get("prompt_ids_tail"), m.get("penalty_ids", []), m.get("first_tokens", [])
    for name, ids in (("prompt_ids_tail", tail), ("penalty_ids", penalty_ids), ("first_tokens", firsts)):
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise CodecError(f"KV header field {name!r} must be a list of ints")
    if len(specs) != 2 * m["num_layers"]:
        raise CodecError(f"header says {m['num_layers']} layers but carries {len(specs)} tensors")
    for i, s in enumerate(specs):
        if s.dtype != m["dtype"] or len(s.shape) < 2 or s.shape[-2] != m["num_tokens"]:
            raise CodecError(f"KV tensor {i} {s} does not hold {m['num_tokens']} tokens of {m['dtype']}")
    sampling = sampling_from_dict(m.get("sampling"))
    if firsts and (len(firsts) != sampling.n or firsts[0] != m["first_token"]):
        raise CodecError(f"KV header carries {len(firsts)} first tokens for n = {sampling.n}; "
                         "send one per choice, choice 0's equal to first_token")
    return KVPayload(
        request_id=m["request_id"], keys=list(tensors[0::2]), values=list(tensors[1::2]),
        prompt_len=m["prompt_len"], rope_delta=m["rope_delta"], first_token=m["first_token"],
        sampling=sampling, prompt_ids_tail=tail, penalty_ids=penalty_ids, first_tokens=firsts)


# ---------------------------------------------------------------- embeddings (encode -> prefill)
def embeddings_to_parts(request_id: str, embeddings: Sequence[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """Header + one tensor per media item ([num_tokens, hidden]), left on their device."""
    tensors = list(embeddings)
    return make_header(KIND_EMBEDDINGS, {"request_id": request_id}, tensors), tensors


def embeddings_from_parts(header: bytes, tensors: Sequence[torch.Tensor], request_id: str) -> list[torch.Tensor]:
    """The item embeddings of an 'embeddings' payload sent for `request_id`."""
    kind, m, _ = check_parts(header, tensors)
    if kind != KIND_EMBEDDINGS:
        raise CodecError(f"expected an '{KIND_EMBEDDINGS}' payload, got '{kind}'")
    if m.get("request_id") != request_id:
        raise CodecError(f"the embeddings payload is for request {m.get('request_id')!r}, not {request_id!r}")
    return list(tensors)
