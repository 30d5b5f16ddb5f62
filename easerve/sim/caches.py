"""The encoder cache of an encode instance and the prefix cache of a prefill, on the live
bookkeeping classes.

A request's media is named by its content key (`SimRequest.content`; empty: unique to the
request, as the bench's seeded media are), as the live gateway names an item by its content hash.

- `EncoderCache`: the encode service's `EmbeddingCache` rule over the live `EncoderCachePolicy`
  (byte-bounded LRU, single flight), sized by `--encoder-cache-gb` (0: off) and charged the
  profile's embedding bytes. A held request skips the batcher and the encoder; one whose media
  another request is encoding waits for that encode; the rest are encoded and then held. If the
  request encoding a key is cancelled first, its waiters take the encode over.
- `PrefixCache`: the prefill's `PrefixKV` rule over the live `PrefixCache` (easerve/cache/prefix.py),
  from `--prefix-cache-gb` / `--prefix-block-tokens` (`PrefillFields.prefix_cache`; None: off).
  The simulated prompt is the request's media placeholders (named by its content key) followed by
  its text, whose tokens are unique to the request: a later request with the same media hits the
  full blocks of the media alone. The planner counts, and the prefill computes, only the tokens
  not held (the last token is always computed).
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable

from easerve.cache.policy import HIT, MISS, PENDING, EncoderCachePolicy
from easerve.cache.prefix import PrefixCache as PrefixCachePolicy
from easerve.cache.prefix import PrefixCacheConfig, block_hashes
from easerve.sim.workload import Req

__all__ = ["HIT", "MISS", "PENDING", "EncoderCache", "PrefixCache", "content_key"]


def content_key(req: Req) -> str:
    """The request's media identity: its content key, or one of its own."""
    return req.spec.content or f"#request-{req.spec.index}"


class EncoderCache:
    def __init__(self, capacity_gb: float) -> None:
        self.policy = EncoderCachePolicy(int(capacity_gb * 2**30))
        self.waiting: dict[Hashable, list[Req]] = {}   # in-flight key -> requests waiting for it
        self.owner: dict[int, Hashable] = {}           # request encoding a key -> the key
        # in order, for tests: (request, HIT | PENDING | MISS) per lookup, (request, "held") per encode
        self.log: list[tuple[int, str]] = []

    def lookup(self, req: Req) -> str:
        """HIT: held; PENDING: it waits for the request encoding it; MISS: it encodes it (in flight)."""
        key = content_key(req)
        state = self.policy.lookup(key).state
        self.log.append((req.spec.index, state))
        if state == PENDING:
            self.waiting[key].append(req)
        elif state == MISS:
            self.policy.begin(key)
            self.waiting[key] = []
            self.owner[req.spec.index] = key
        return state

    def encoded(self, req: Req, size: int) -> list[Req]:
        """`req`'s encode ended: its embeddings are held; the requests that waited for them."""
        key = self.owner.pop(req.spec.index, None)
        if key is None:
            return []
        self.policy.complete(key, None, size)
        self.log.append((req.spec.index, "held"))
        return self.waiting.pop(key)

    def abandoned(self, req: Req) -> list[Req]:
        """`req` was cancelled: a key it was encoding is forgotten; the requests that waited for it
        (to be looked up again: the first takes the encode over). A waiter is dropped."""
        key = self.owner.pop(req.spec.index, None)
        if key is None:
            for waiters in self.waiting.values():
                if req in waiters:
                    waiters.remove(req)
                    break
            return []
        self.policy.fail(key)
        return self.waiting.pop(key)


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig, kv_bytes_per_token: int) -> None:
        self.policy = PrefixCachePolicy(config, kv_bytes_per_token * config.block_tokens)
        self.block_tokens = config.block_tokens
        self._hashes: dict[int, list[bytes]] = {}   # request -> its prompt's block names
        self._held: dict[int, int] = {}             # request -> leading blocks it references while it runs
        self.hits: list[tuple[int, int]] = []       # (request, cached prompt tokens) per prefill, for tests

    def hashes(self, req: Req) -> list[bytes]:
        h = self._hashes.get(req.spec.index)
        if h is None:
            media = hashlib.sha256(content_key(req).encode()).digest()
            ids = [0] * req.media_tokens + [-1 - req.spec.index] * (req.prompt_tokens - req.media_tokens)
            h = self._hashes[req.spec.index] = block_hashes(ids, dict.fromkeys(range(req.media_tokens), media),
                                                            self.block_tokens)
        return h

    def _limit(self, req: Req) -> int:
        return (req.prompt_tokens - 1) // self.block_tokens

    def to_compute(self, req: Req) -> int:
        """Prompt tokens a prefill would compute now (`PrefixKV.to_compute`)."""
        return req.prompt_tokens - self.block_tokens * self.policy.match(self.hashes(req), self._limit(req))

    def lookup(self, req: Req) -> int:
        """At the batch: the held prefix is referenced until `done`; the tokens to compute."""
        hashes = self.hashes(req)
        n = self.policy.match(hashes, self._limit(req))
        self.policy.acquire(hashes[:n])
        self._held[req.spec.index] = n
        self.hits.append((req.spec.index, n * self.block_tokens))
        return req.prompt_tokens - n * self.block_tokens

    def done(self, index: int) -> None:
        """Request `index`'s batch ended: its prompt's blocks are kept (computed, even when the
        request has gone since), its reference dropped."""
        hashes = self._hashes.pop(index, [])
        self.policy.insert(hashes)
        self.policy.release(hashes[:self._held.pop(index, 0)])

    def forget(self, index: int) -> None:
        """Request `index` left before its batch."""
        self._hashes.pop(index, None)
