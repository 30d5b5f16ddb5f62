"""The encode process's encoder cache: embeddings under the pure `EncoderCachePolicy`.

A request's items are looked up by (this process's fingerprint, the gateway's content
hash). Held items skip the batcher and the tower; items another request is encoding now
wait for that encode (single flight); the rest go through the encode loop together, and
their embeddings are held for later requests (byte-bounded LRU). If the encode that others
wait on fails, they fail with an error naming it; if its request was cancelled, a waiter
takes the encode over.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from easerve.cache.policy import HIT, MISS, EncoderCachePolicy
from easerve.errors import CacheMiss, Internal
from easerve.types import MMItem


def model_fingerprint(model: str, dtype: str, device: str) -> bytes:
    """sha256 of what changes embeddings besides the media: the checkpoint (its path, config
    and weight files' names, sizes and mtimes: a revision), the dtype and the device type."""
    h = hashlib.sha256(f"{Path(model).resolve()}\0{dtype}\0{device.split(':')[0]}\0".encode())
    folder = Path(model)
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    return h.digest()


def tensor_nbytes(t) -> int:
    return t.numel() * t.element_size()


def _own(t):
    """The tensor itself, or a copy when it is a view into a larger (batch) buffer, so the
    held bytes are the counted bytes."""
    return t.clone() if t.untyped_storage().nbytes() > tensor_nbytes(t) else t


class _Abandoned(Exception):
    """The request encoding an item was cancelled: a waiter should encode it itself."""


@dataclass(frozen=True)
class CachedEncode:
    embeddings: list
    queue_ms: float
    encode_ms: float
    hits: int          # items answered from the cache or by another request's encode


EncodeFn = Callable[[str, list[MMItem]], Awaitable]  # EncodeLoop.encode


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, fingerprint: bytes, metrics=None):
        self.policy = EncoderCachePolicy(capacity_bytes)
        self.fingerprint = fingerprint
        self.m = metrics
        self._flights: dict[bytes, asyncio.Future] = {}
        if metrics is not None:
            metrics.capacity.set(capacity_bytes)

    def key(self, content_hash: bytes) -> bytes:
        return hashlib.sha256(self.fingerprint + content_hash).digest()

    def holds(self, hashes: list[bytes]) -> list[bool]:
        return [bool(h) and self.policy.holds(self.key(h)) for h in hashes]

    async def encode(self, rid: str, items: list[MMItem], run: EncodeFn) -> CachedEncode:
        """Embeddings of `items` (prompt order), encoding through `run` only what no one holds
        or is encoding now. Raises CacheMiss for an item sent without inputs that is not held."""
        out: list = [None] * len(items)
        todo = list(range(len(items)))
        queue_ms = encode_ms = 0.0
        hits = 0
        while todo:
            own, waits = self._claim(items, todo, out)
            hits += len(todo) - len(own) - len(waits)
            if own:
                res = await self._run_owned(rid, items, own, run)
                queue_ms, encode_ms = queue_ms + res.queue_ms, encode_ms + res.encode_ms
                for i, e in zip(own, res.embeddings):
                    out[i] = e
            todo = await self._await_waits(waits, out)
            hits += len(waits) - len(todo)
        self._observe_held()
        return CachedEncode(out, queue_ms, encode_ms, hits)

    def _claim(self, items: list[MMItem], todo: list[int], out: list) -> tuple[list[int], list]:
        """Look every item up: fill hits into `out`; return (items this request encodes,
        items it waits for). Items without a hash are always encoded here."""
        own, waits, began = [], [], []
        for i in todo:
            h = items[i].content_hash
            if not h:
                own.append(i)
                continue
            k = self.key(h)
            found = self.policy.lookup(k)
            self._count(found.state)
            if found.state == HIT:
                out[i] = found.value
                if self.m is not None and not items[i].pixels:
                    self.m.pixel_free.inc()
            elif found.state == MISS:
                if not items[i].pixels:
                    for b in began:
                        self._settle(b, _Abandoned())
                    raise CacheMiss.of_item(i, items[i].modality, "is not held by this encode instance")
                self.policy.begin(k)
                self._flights[k] = asyncio.get_running_loop().create_future()
                began.append(k)
                own.append(i)
            else:
                waits.append((i, self._flights[k]))
        return own, waits

    async def _run_owned(self, rid: str, items: list[MMItem], own: list[int], run: EncodeFn):
        keys = [self.key(items[i].content_hash) if items[i].content_hash else None for i in own]
        try:
            res = await run(rid, [items[i] for i in own])
        except asyncio.CancelledError:
            for k in keys:
                self._settle(k, _Abandoned())
            raise
        except Exception as e:  # noqa: BLE001 - re-raised; waiters learn why
            for k in keys:
                self._settle(k, Internal(f"the encode of this media by request {rid} failed "
                                         f"({type(e).__name__}: {e})"))
            raise
        if self.m is not None:
            self.m.tower_items.inc(len(own))
        for k, e in zip(keys, res.embeddings):
            if k is not None:
                self._settle(k, value=_own(e))
        return res

    def _settle(self, key: bytes | None, error: BaseException | None = None, value=None) -> None:
        """Finish an in-flight key: hold its value (waking waiters) or fail it."""
        if key is None:
            return
        fut = self._flights.pop(key)
        if error is not None:
            self.policy.fail(key)
            fut.set_exception(error)
            fut.add_done_callback(lambda f: f.exception())  # retrieved even with no waiter
            return
        evicted = self.policy.complete(key, value, tensor_nbytes(value))
        if self.m is not None and evicted:
            self.m.evictions.inc(len(evicted))
        fut.set_result(value)

    async def _await_waits(self, waits: list, out: list) -> list[int]:
        """Wait for other requests' encodes; the items whose encoder was cancelled come back."""
        again = []
        for i, fut in waits:
            try:
                out[i] = await asyncio.shield(fut)
            except _Abandoned:
                again.append(i)
        return again

    def _count(self, state: str) -> None:
        if self.m is not None:
            {HIT: self.m.hits, MISS: self.m.misses}.get(state, self.m.joins).inc()

    def _observe_held(self) -> None:
        if self.m is not None:
            self.m.bytes.set(self.policy.bytes)
            self.m.entries.set(len(self.policy))

