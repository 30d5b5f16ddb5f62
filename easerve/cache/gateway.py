"""The gateway's side of the encoder cache (easerve.cache.policy; easerve.cache.embeddings).

Before any media is decoded, the gateway hashes each item as it was received
(easerve.media.content_hash; a URL after fetching it), picks the encode instance that probably holds
those hashes (`HolderMap`: where it sent them last, when that instance's load allows, see
`encoder_cache_affinity`) and asks that instance which it holds (`Encode.Holds`). Then:

- every item held, and every item's prompt metadata known (`KnownItems`, learned when this
  gateway last preprocessed the same hash: the processor's placeholder replacement, the token
  count, the small meta tensors prefill needs): the prompt is built from the chat template's
  text alone (`HFAdapter.prompt_from_items`): no decoding, no HF processor, no pixels sent
  (`MediaPlan.skipped`);
- otherwise the request is preprocessed in full, and the items the instance holds still go
  without their pixels.

If the instance no longer holds an item when the request comes (evicted since, or the request
went to another instance) it answers a CacheMiss (NOT_FOUND + reason ENCODER_CACHE_MISS); the
gateway then preprocesses the request in full if it had skipped that, and resends every item
with its pixels (`GatewayCore._encode_call`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import numpy as np

from easerve.cache.policy import HolderMap
from easerve.media.content_hash import assign_by_modality, media_hash, processor_fingerprint
from easerve.errors import Unavailable
from easerve.types import MediaPart, MMItem, ProcessedPrompt
from easerve.wire.v1 import encode_pb2

log = logging.getLogger("easerve.gateway")
PROBE_TIMEOUT_S = 1.0


@dataclass
class MediaPlan:
    """The encoder-cache side of one request, decided before its media are decoded."""

    pairs: list[tuple[str, bytes]]            # (modality, content hash) per media part, request order
    target: str | None = None                 # the encode instance to send to (None: least loaded)
    held: dict[bytes, bool] = field(default_factory=dict)  # what `target` said it holds (empty: not asked)
    skipped: bool = False                     # the prompt was built without preprocessing the media

    @property
    def hashes(self) -> list[bytes]:
        return list(dict.fromkeys(h for _, h in self.pairs))

    @property
    def all_held(self) -> bool:
        return bool(self.pairs) and all(self.held.get(h, False) for _, h in self.pairs)


@dataclass(frozen=True)
class _Known:
    modality: str
    meta: dict
    num_tokens: int
    unit: str       # the replacement is `unit * repeat` (a run of placeholder tokens, stored short)
    repeat: int


class KnownItems:
    """Count-bounded LRU of media hash -> what a prompt needs of that item (never its pixels)."""

    def __init__(self, max_entries: int, placeholders: dict[str, str]):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries, self.placeholders = max_entries, placeholders
        self._items: OrderedDict[bytes, _Known] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def learn(self, items: list[MMItem]) -> None:
        for it in items:
            if not it.content_hash or not it.replacement:
                continue
            unit, repeat = _compact(it.replacement, self.placeholders.get(it.modality, ""))
            self._items[it.content_hash] = _Known(it.modality, dict(it.meta), it.num_tokens, unit, repeat)
            self._items.move_to_end(it.content_hash)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, content_hash: bytes) -> MMItem | None:
        """A pixel-free item for `content_hash`, or None when it was not learned (or was dropped)."""
        k = self._items.get(content_hash)
        if k is None:
            return None
        self._items.move_to_end(content_hash)
        return MMItem(k.modality, {}, dict(k.meta), k.num_tokens, content_hash, k.unit * k.repeat)


def _compact(replacement: str, token: str) -> tuple[str, int]:
    n = len(replacement) // len(token) if token else 0
    return (token, n) if n and token * n == replacement else (replacement, 1)


class MediaCache:
    """Hashes, known items, placement and the Holds probe, for one gateway."""

    def __init__(self, adapter, media_cfg, enc_peers, max_entries: int, affinity: int):
        self.enc, self.affinity = enc_peers, affinity
        self.holders = HolderMap(max_entries)
        self.known = KnownItems(max_entries, dict(adapter.placeholder_tokens))
        self.fingerprint = processor_fingerprint(adapter.processor, media_cfg, adapter.family)

    # ---- hashes ---------------------------------------------------------------------------
    def hash_parts(self, parts: list[MediaPart]) -> list[tuple[str, bytes]]:
        """(modality, content hash) of each media part, from what the request sent (fetched
        bytes for URLs; a part without a ref: its decoded value), before any decoding.
        MediaError (a ValueError) for a payload that is not valid base64."""
        pairs = []
        for part in parts:
            ref = part.ref
            raw = getattr(ref, "source", None)
            value = raw if isinstance(raw, (bytes, bytearray, str, list, np.ndarray)) else part.value
            settings = {"fps": getattr(ref, "fps", None), "sample_rate": getattr(ref, "sample_rate", None),
                        "part_fps": part.fps}
            pairs.append((part.kind, media_hash(self.fingerprint, part.kind, value, settings)))
        return pairs

    # ---- the plan ---------------------------------------------------------------------------
    async def plan(self, pairs: list[tuple[str, bytes]], timeout_s: float | None) -> MediaPlan:
        """Where to send these media, and (when this gateway sent them there before) what that
        instance holds now."""
        target, known = self._place([h for _, h in pairs])
        plan = MediaPlan(pairs, target)
        if known:
            plan.held = await self._probe(target, plan.hashes, timeout_s)
        return plan

    def known_items(self, plan: MediaPlan) -> dict[str, list[MMItem]] | None:
        """The learned pixel-free items of every part, per modality in request order; None
        unless every one is known."""
        out: dict[str, list[MMItem]] = {}
        for kind, h in plan.pairs:
            it = self.known.get(h)
            if it is None or it.modality != kind:
                return None
            out.setdefault(kind, []).append(it)
        return out

    def learn(self, plan: MediaPlan, prompt: ProcessedPrompt) -> None:
        """Give the preprocessed items their hashes (the k-th item of a modality gets the k-th
        part's) and remember what a later prompt for the same media needs."""
        hashes = assign_by_modality(plan.pairs, [it.modality for it in prompt.items]) if prompt.items else None
        for it, h in zip(prompt.items, hashes or ()):
            it.content_hash = h
        if hashes:
            self.known.learn(prompt.items)

    def held_items(self, plan: MediaPlan, prompt: ProcessedPrompt, addr: str | None) -> list[bool]:
        """Which items go to `addr` without their pixels: all of a skipped prompt (it has none),
        else those the probed instance said it holds, when `addr` is that instance."""
        if plan.skipped:
            return [True] * len(prompt.items)
        if addr != plan.target:
            return [False] * len(prompt.items)
        return [plan.held.get(it.content_hash, False) for it in prompt.items]

    def sent(self, plan: MediaPlan, addr: str) -> None:
        """The request's media went to `addr` (it will hold them, or is encoding them now)."""
        self.holders.note(plan.hashes, addr)

    def missed(self, plan: MediaPlan, addr: str) -> None:
        """`addr` answered it does not hold some of the request's media."""
        self.holders.forget(plan.hashes, addr)

    # ---- placement and the probe ------------------------------------------------------------------
    def _place(self, keys: list[bytes]) -> tuple[str | None, bool]:
        """(the encode instance to prefer for these media, or None to leave it to `Peers`;
        whether this gateway sent it any of them before: only then is it worth a probe). The
        media are noted at it at once, so concurrent requests for them meet in one encode."""
        addr = self.holders.holder(keys)
        peer = self.enc.get(addr) if addr else None
        known = peer is not None and self._affine(peer)
        if not known:
            try:
                peer = self.enc.pick()
            except Unavailable:
                return None, False  # start_call waits for an instance, or says none is up
        self.holders.note(keys, peer.addr)
        return peer.addr, known

    def _affine(self, peer) -> bool:
        """Whether `peer` is up and has at most `affinity` more calls open (from this gateway)
        than the least-loaded instance that is up."""
        if not peer.up:
            return False
        least = min(q.outstanding for q in map(self.enc.get, self.enc.addrs) if q.up)
        return peer.outstanding <= least + self.affinity

    async def _probe(self, addr: str, hashes: list[bytes], timeout_s: float | None) -> dict[bytes, bool]:
        """Which of `hashes` the encode instance `addr` holds now (none when it cannot say)."""
        peer = self.enc.get(addr)
        try:
            resp = await peer.stub.Holds(encode_pb2.HoldsRequest(content_hashes=hashes),
                                         timeout=min(PROBE_TIMEOUT_S, timeout_s or PROBE_TIMEOUT_S))
        except grpc.aio.AioRpcError as e:  # an old or busy encode: preprocess and send pixels, nothing lost
            log.debug("encoder cache probe of %s failed: %s", addr, e.code().name)
            return {}
        return dict(zip(hashes, resp.held)) if len(resp.held) == len(hashes) else {}
