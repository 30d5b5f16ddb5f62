"""Prefix cache, the prefill side: the KV tensors of the blocks `PrefixCache` keeps.

Used by the prefill loop around each batched forward, all in its one worker thread:

    kv = PrefixKV.for_adapter(adapter, PrefixCacheConfig(...))
    looks = [kv.lookup(req) for req in batch]       # hits referenced: safe from eviction
    results = adapter.prefill(batch, [l.prefix for l in looks])
    for req, look, res in zip(batch, looks, results):
        kv.store(look, res)                         # the prompt's new full blocks, within budget
    for look in looks: kv.release(look)

A lookup never covers the whole prompt (the last token is always computed: its logits give
the first token), and counts `queries` / `hits` in prompt tokens as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from easerve.cache.prefix import PrefixCache, PrefixCacheConfig, block_hashes, media_positions
from easerve.types import CachedPrefix, PrefillRequest, PrefillResult


@dataclass(frozen=True)
class Lookup:
    hashes: list[bytes]            # the prompt's full blocks
    hit_blocks: int                # leading blocks held (and referenced until release)
    prefix: CachedPrefix | None    # their KV, None on a miss


def request_items(req: PrefillRequest) -> list[tuple[str, int, bytes]]:
    return [(m.modality, int(e.shape[0]), m.content_hash) for e, m in zip(req.embeddings, req.items_meta)]


class PrefixKV:
    def __init__(self, config: PrefixCacheConfig, block_bytes: int, placeholder_ids: dict[str, int]):
        self.policy = PrefixCache(config, block_bytes)
        self.block_tokens = config.block_tokens
        self.placeholder_ids = dict(placeholder_ids)
        self._blocks: dict[bytes, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.queries = self.hits = 0  # prompt tokens looked up / answered, since start

    @classmethod
    def for_adapter(cls, adapter, config: PrefixCacheConfig) -> "PrefixKV":
        tc = adapter.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        per_token = 2 * tc.num_hidden_layers * tc.num_key_value_heads * head_dim * adapter.dtype.itemsize
        return cls(config, per_token * config.block_tokens, getattr(adapter, "placeholder_ids", {}))

    def hashes(self, req: PrefillRequest) -> list[bytes]:
        media = media_positions(req.input_ids, request_items(req), self.placeholder_ids)
        return block_hashes(req.input_ids, media, self.block_tokens)

    def to_compute(self, req: PrefillRequest) -> int:
        """Prompt tokens a prefill would compute now (the batch token budget counts these).
        Reads the policy only (membership tests), so another thread may call it."""
        return len(req.input_ids) - self.block_tokens * self.policy.match(
            self.hashes(req), (len(req.input_ids) - 1) // self.block_tokens)

    def lookup(self, req: PrefillRequest) -> Lookup:
        hashes = self.hashes(req)
        n = self.policy.match(hashes, (len(req.input_ids) - 1) // self.block_tokens)
        self.policy.acquire(hashes[:n])
        self.queries += len(req.input_ids)
        self.hits += n * self.block_tokens
        if n == 0:
            return Lookup(hashes, 0, None)
        blocks = [self._blocks[h] for h in hashes[:n]]
        layers = range(len(blocks[0][0]))
        keys = [torch.cat([b[0][i] for b in blocks], dim=1) for i in layers]
        values = [torch.cat([b[1][i] for b in blocks], dim=1) for i in layers]
        return Lookup(hashes, n, CachedPrefix(keys, values, n * self.block_tokens))

    def store(self, look: Lookup, result: PrefillResult) -> None:
        """Keep the computed prompt's full blocks (copies: the result's KV goes to decode)."""
        plan = self.policy.insert(look.hashes)
        for h in plan.evict:
            del self._blocks[h]
        bt = self.block_tokens
        for i in plan.store:
            sl = slice(i * bt, (i + 1) * bt)
            self._blocks[look.hashes[i]] = ([k[:, sl].clone() for k in result.keys],
                                            [v[:, sl].clone() for v in result.values])

    def release(self, look: Lookup) -> None:
        self.policy.release(look.hashes[:look.hit_blocks])
