"""Prefix-cache placement, the caller's side: send a request to the prefill instance that
probably holds its longest cached prefix, while that instance's load allows.

Torch-free. The caller (encode for media requests, the gateway for text-only ones) names the
prompt's blocks as prefill does (`easerve.cache.prefix.block_hashes`, same block size) and
remembers where it sent each block last (`HolderMap`, count-bounded LRU): an approximate
index of the instances' caches, as llm-d's and Dynamo's routers keep, with no probe on the
request path. The holder of the prompt's longest noted prefix is preferred when it has at
most `affinity` more calls open than the least-loaded instance that is up.

    route = PrefixRoute(block_tokens=16, placeholder_ids={"image": 151655})
    hashes = route.hashes(input_ids, [(modality, rows, content_hash), ...])
    prefer = route.prefer(hashes, up_loads(peers))   # an address, or None: least loaded
    ... peers.start_call(..., prefer=prefer) ...
    route.sent(hashes, peer.addr)
"""
from __future__ import annotations

from collections.abc import Sequence

from easerve.cache.policy import HolderMap
from easerve.cache.prefix import block_hashes, media_positions


class PrefixRoute:
    def __init__(self, block_tokens: int, placeholder_ids: dict[str, int] | None = None,
                 max_entries: int = 1 << 16, affinity: int = 4):
        self.block_tokens, self.affinity = block_tokens, affinity
        self.placeholder_ids = dict(placeholder_ids or {})
        self.holders = HolderMap(max_entries)

    def hashes(self, input_ids: list[int], items: Sequence[tuple[str, int, bytes]] = ()) -> list[bytes]:
        media = media_positions(input_ids, list(items), self.placeholder_ids) if items else {}
        return block_hashes(input_ids, media, self.block_tokens)

    def holder(self, hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """(instance noted for the longest prefix of `hashes`, its length in blocks)."""
        for n in range(len(hashes), 0, -1):
            addr = self.holders.holder([hashes[n - 1]])
            if addr is not None:
                return addr, n
        return None, 0

    def prefer(self, hashes: Sequence[bytes], loads: dict[str, int]) -> str | None:
        """The holder of the longest prefix when its load allows. `loads`: calls this caller
        has open on each instance that is up (`up_loads(peers)`)."""
        addr, _ = self.holder(hashes)
        if addr not in loads:
            return None
        return addr if loads[addr] <= min(loads.values()) + self.affinity else None

    def sent(self, hashes: Sequence[bytes], addr: str) -> None:
        self.holders.note(hashes, addr)


def up_loads(peers) -> dict[str, int]:
    """{address: calls open} of the instances of an easerve Peers that are up."""
    return {a: p.outstanding for a in peers.addrs if (p := peers.get(a)) is not None and p.up}
