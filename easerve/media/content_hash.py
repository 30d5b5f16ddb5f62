"""Content hashes of media for the encoder cache (computed at the gateway, torch-free).

A media item's hash is sha256 over: a fingerprint of everything at the gateway that changes
what the encoder is given (the model's processor settings and the gateway's media decoding
config), the modality, the request's per-item settings (video fps, audio sample rate), and
the media as the gateway received it: the raw bytes of a file (a data: URI or base64 text
counts as the bytes it carries, so the SDK and the HTTP API share entries),
each frame of a frame list, or the samples of an array. Media that came as decoded objects
(PIL images, arrays) are hashed over their mode, shape and pixels.

The encode instance combines this hash with its own fingerprint (model, weights, dtype,
device), so a hash never meets embeddings of another model.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from easerve.media.common import to_bytes

_IMAGE_ATTRS = ("image_processor", "video_processor", "feature_extractor")


def processor_fingerprint(processor, media_config: Any = None, family: str = "") -> bytes:
    """sha256 of the processor settings that shape encoder inputs, plus the media config."""
    parts: dict[str, Any] = {"family": family, "media": repr(media_config)}
    for name in _IMAGE_ATTRS:
        sub = getattr(processor, name, None)
        if sub is not None:
            parts[name] = sub.to_dict()
    blob = json.dumps(parts, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).digest()


def _feed(h, value: Any, what: str = "media") -> None:
    """Hash one media value (recursively for frame lists), tagged by its kind. A string that is
    not valid base64 raises MediaError (an InvalidRequest: bad input) naming `what`."""
    if isinstance(value, str):  # a data: URI or base64: its bytes, so every front shares entries
        value = to_bytes(value, what)
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        h.update(b"b%d:" % len(b))
        h.update(b)
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(f"a{a.dtype.str}{a.shape}:".encode())
        h.update(a.tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(b"l%d:" % len(value))
        for v in value:
            _feed(h, v, what)
    elif hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):  # PIL image
        h.update(f"p{value.mode}{tuple(value.size)}:".encode())
        h.update(value.tobytes())
    else:
        raise ValueError(f"cannot hash media of type {type(value).__name__} for the encoder cache")


def media_hash(fingerprint: bytes, modality: str, value: Any, settings: dict | None = None) -> bytes:
    """The 32-byte content hash of one media item."""
    h = hashlib.sha256()
    h.update(fingerprint)
    h.update(modality.encode() + b"\0")
    h.update(json.dumps(settings or {}, sort_keys=True).encode() + b"\0")
    _feed(h, value, modality)
    return h.digest()


def assign_by_modality(hashes: Iterable[tuple[str, bytes]], modalities: list[str]) -> list[bytes] | None:
    """Match (modality, hash) pairs, in request order, to the prompt's items (given by
    modality, in prompt order): the k-th item of a modality gets the k-th hash of it.
    None when the counts disagree (then nothing is cached for that request)."""
    by_kind: dict[str, list[bytes]] = {}
    for kind, h in hashes:
        by_kind.setdefault(kind, []).append(h)
    taken: dict[str, int] = {}
    out = []
    for kind in modalities:
        i = taken.get(kind, 0)
        pool = by_kind.get(kind, [])
        if i >= len(pool):
            return None
        out.append(pool[i])
        taken[kind] = i + 1
    if any(taken.get(k, 0) != len(v) for k, v in by_kind.items()):
        return None
    return out
