"""One stage of the split E -> P -> D path as its own OS process, for the
cross-process invariant test. Stages talk only through easerve.wire.codec files:

  encode:  req*.bin  (input ids + processor outputs) -> emb*.bin (embeddings + item meta)
  prefill: emb*.bin  -> kv*.bin  (KVPayload: prompt KV, first token, positions, sampling)
  decode:  kv*.bin   -> tokens.json (all requests decoded together by the engine)

Run: python -m tests.models.split_worker ROLE MODEL_DIR WORK_DIR N
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from easerve.engine.detok import prompt_tail
from easerve.wire.codec import check_parts, join_parts, kv_from_parts, kv_to_parts, make_header, split_parts
from easerve.types import MMItem, PrefillRequest, SamplingParams, items_meta


def encode_tensors(meta: dict, tensors: list) -> bytes:
    return join_parts(make_header("tensors", meta, tensors), tensors)


def decode_tensors(buf: bytes) -> tuple[dict, list]:
    header, tensors = split_parts(buf)
    return check_parts(header, tensors)[1], tensors


def write_request(path: Path, input_ids: list[int], items: list[MMItem]) -> None:
    """Parent side: one processed prompt as a codec file."""
    meta, tensors = {"input_ids": input_ids, "items": []}, []
    for it in items:
        meta["items"].append({"modality": it.modality, "num_tokens": it.num_tokens,
                              "pixels": list(it.pixels), "meta": list(it.meta)})
        tensors += list(it.pixels.values()) + list(it.meta.values())
    path.write_bytes(encode_tensors(meta, tensors))


def _read_items(meta: dict, tensors: list, with_pixels: bool) -> list[MMItem]:
    items, i = [], 0
    for d in meta["items"]:
        pixels = {}
        if with_pixels:
            pixels = dict(zip(d["pixels"], tensors[i:i + len(d["pixels"])]))
            i += len(d["pixels"])
        m = dict(zip(d["meta"], tensors[i:i + len(d["meta"])]))
        i += len(d["meta"])
        items.append(MMItem(d["modality"], pixels, m, d["num_tokens"]))
    return items


def encode(adapter, work: Path, n: int) -> None:
    for k in range(n):
        meta, tensors = decode_tensors((work / f"req{k}.bin").read_bytes())
        items = _read_items(meta, tensors, with_pixels=True)
        embeds = adapter.encode(items)
        out_meta = {"input_ids": meta["input_ids"],
                    "items": [{**d, "pixels": []} for d in meta["items"]]}
        flat = [t for it in items for t in it.meta.values()]
        (work / f"emb{k}.bin").write_bytes(encode_tensors(out_meta, flat + list(embeds)))


def prefill(adapter, work: Path, n: int) -> None:
    from easerve.engine.sampler import sample
    from easerve.types import KVPayload

    for k in range(n):
        meta, tensors = decode_tensors((work / f"emb{k}.bin").read_bytes())
        n_meta = sum(len(d["meta"]) for d in meta["items"])
        items = _read_items(meta, tensors[:n_meta], with_pixels=False)
        sp = SamplingParams(max_tokens=8)
        req = PrefillRequest(f"r{k}", meta["input_ids"], tensors[n_meta:],
                             items_meta(items), sp)
        res = adapter.prefill([req])[0]
        first = sample(res.last_logits[None], [sp], [0])[0]
        payload = KVPayload(req.request_id, res.keys, res.values, res.prompt_len, res.rope_delta,
                            first, sp, prompt_ids_tail=prompt_tail(meta["input_ids"]))
        (work / f"kv{k}.bin").write_bytes(join_parts(*kv_to_parts(payload)))


def decode(adapter, work: Path, n: int) -> None:
    from easerve.engine.config import EngineConfig
    from easerve.engine.engine import DecodeEngine

    engine = DecodeEngine(adapter, EngineConfig(num_slots=4, max_seq_len=2048))
    for k in range(n):
        engine.add(kv_from_parts(*split_parts((work / f"kv{k}.bin").read_bytes())))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            if o.token_id is not None:
                tokens.setdefault(o.request_id, []).append(o.token_id)
    (work / "tokens.json").write_text(json.dumps([tokens[f"r{k}"] for k in range(n)]))


def main(argv: list[str]) -> None:
    from easerve.models.loader import load_adapter

    role, model, work, n = argv[0], argv[1], Path(argv[2]), int(argv[3])
    torch.set_num_threads(1)
    adapter = load_adapter(model, role=role)
    with torch.inference_mode():
        {"encode": encode, "prefill": prefill, "decode": decode}[role](adapter, work, n)


if __name__ == "__main__":
    main(sys.argv[1:])
