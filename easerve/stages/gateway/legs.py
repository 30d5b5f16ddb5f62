"""A request's legs: its place at one decode instance and the upstream call that filled it.
A request whose decode stream breaks moves to a new leg (GatewayCore's mid-stream migration)
when `resumable` says the tokens it sent can be prefilled again."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger("easerve.gateway")


def resumable(adapter, job, sent: list[int]) -> bool:
    """Whether the tokens `sent` can follow the prompt in a new prefill: a media placeholder id
    among them would be taken for a media item's place (a model never trained to emit one
    does not; a random tiny checkpoint may)."""
    held = set(getattr(adapter, "placeholder_ids", {}).values()).intersection(sent)
    if held:
        log.warning("request %s: not migrated, its output holds media placeholder id(s) %s",
                    job.request_id, sorted(held))
    return not held


@dataclass
class Leg:
    """A request's place at one decode instance and the upstream call that filled it
    (`GatewayCore._reserved_call`); a migrated request has one leg per decode instance."""

    dpeer: object
    dcall: object
    upeers: object
    upeer: object
    ucall: object
    first: object                        # the upstream call's first message
    tail: asyncio.Future | None = None   # the upstream call's end (the KV handoff), once awaited
    closed: bool = False

    def close(self, decode_peers) -> None:
        """Cancel both calls (frees the stages' work) and give back both peers; once."""
        if self.closed:
            return
        self.closed = True
        self.dcall.cancel()
        self.ucall.cancel()
        if self.tail is not None and not self.tail.done():
            self.tail.cancel()
        self.upeers.finish(self.upeer)
        decode_peers.finish(self.dpeer)
