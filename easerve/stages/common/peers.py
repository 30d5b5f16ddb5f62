"""The instances of a downstream stage, as one caller sees them.

`Peers` keeps one channel per instance and a background poll of each one's health
(grpc.health.v1) and load (`easerve.v1.Stage/Load`: requests held, node identity).
`pick()` places a request by least outstanding work (`control.placement.LeastLoaded`),
skipping instances that are down (a poll refused, or DOWN_AFTER_TIMEOUTS polls in a row
unanswered) or NOT_SERVING; `start_call()` opens a streaming call
and retries once on another instance when it fails before its first message (never for a
message over the size limit, which fits nowhere); a caller whose failed call may have done
work elsewhere first retries itself (the gateway: the call may have filled its decode
reservation, so it retries under a new one).
`relay()` turns a streaming call's failure into the domain error.

The set of instances may change while running (`easerve.stages.common.peer_sources`: DNS names
looked up again, the launcher's peers file): the poll loop applies each new list. A new
instance is a candidate once a poll finds it SERVING; one that left the list (or drains:
NOT_SERVING) gets no new calls, its open calls finish, and its channel is closed once a poll
finds it gone and this caller has none open on it (until then the work it holds may need
calls: a draining decode instance takes the KV of the reservations it holds).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from easerve.policy.placement import POLL_S, Candidate, LeastLoaded
from easerve.stages.common.peer_sources import PeerSource
from easerve.rpc.errors import from_peer_error
from easerve.errors import Overloaded, Unavailable
from easerve.rpc.tls import NO_TLS, Tls, aio_channel, connected
from easerve.transport.node import NodeIdentity, shm_probe
from easerve.wire.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)
DOWN_AFTER_TIMEOUTS = 3  # polls in a row that time out before a live instance counts as down
READY_S = 3.0  # how long reach_of waits for a channel to an instance to connect


@dataclass
class Peer:
    addr: str
    stub: object
    channel: grpc.aio.Channel
    up: bool = True          # optimistic until the first poll says otherwise
    reported: int = 0
    capacity: int = 0
    node: NodeIdentity | None = None
    outstanding: int = 0     # calls this caller has open on it
    gone: bool = False       # the last poll could not reach it
    timeouts: int = 0        # polls in a row that timed out (busy or stalled: unknown yet)
    sent_since_poll: int = 0
    polled_at: float = 0.0
    queued: int = 0          # waiting for compute at the last poll (a batcher's queue, decode's admission queue)
    overdue: int = 0         # of those, the ones its deadline order put last (yielding or past their deadline)
    kv_free_tokens: int = 0  # decode only: KV room at the last poll
    recent_batch_s: float = 0.0     # its recent pace at the last poll (easerve/stages/common/pace.py)
    recent_batch_size: float = 0.0
    busy_s: float = 0.0      # its compute seconds so far, at the last poll (0: not reported)
    load_stub: object = field(default=None, repr=False)
    health_stub: object = field(default=None, repr=False)

    def candidate(self) -> Candidate:
        return Candidate(self.addr, self.up, self.reported, self.sent_since_poll, self.capacity)


class Peers:
    def __init__(self, stub_cls, addrs: Sequence[str], channel_options=(), service: str = "",
                 poll_s: float = POLL_S, source: PeerSource | None = None,
                 on_closed: Callable[[str], Awaitable[None]] | None = None, tls: Tls = NO_TLS):
        """`addrs`: the instances (see PeerSource), or `source` where they may change;
        `on_closed(addr)`: awaited after a removed instance's channel is closed."""
        self.service, self.poll_s = service, poll_s
        self._stub_cls, self._options, self._on_closed, self._tls = stub_cls, list(channel_options), on_closed, tls
        self._source = source or PeerSource(addrs)
        self._peers: dict[str, Peer] = {}
        self._retired: dict[str, Peer] = {}  # left the list; kept until their calls finish
        if self._source.static:  # known now: optimistic until the first poll
            for a in self._source.static_addrs():
                self._peers[a] = self._new_peer(a, up=True)
        self._policy = LeastLoaded()
        self._task: asyncio.Task | None = None
        self._polled = asyncio.Event()
        self._refresh_lock: asyncio.Lock | None = None

    def _new_peer(self, addr: str, up: bool) -> Peer:
        ch = aio_channel(addr, self._options, self._tls)
        return Peer(addr, self._stub_cls(ch), ch, up=up, load_stub=stage_pb2_grpc.StageStub(ch),
                    health_stub=health_pb2_grpc.HealthStub(ch))

    def __bool__(self) -> bool:
        """Whether this role has instances, or addresses that may name some."""
        return bool(self._peers) or bool(self._source.configured)

    def __len__(self) -> int:
        return len(self._peers)

    def up_peers(self) -> list[Peer]:
        """The instances that were up and serving at the last look."""
        return [p for p in self._peers.values() if p.up]

    @property
    def addrs(self) -> list[str]:
        """The instances in the current list (not those removed and finishing calls)."""
        return list(self._peers)

    def untried(self, tried) -> list[str]:
        """The instances in the current list that are not in `tried`."""
        return [a for a in self._peers if a not in tried]

    @property
    def retired(self) -> list[str]:
        return list(self._retired)

    def get(self, addr: str) -> Peer | None:
        """The instance at `addr`, listed or removed but still finishing calls."""
        return self._peers.get(addr) or self._retired.get(addr)

    async def lookup(self, addr: str) -> Peer | None:
        """`get`, after looking the addresses up again when `addr` is not known (another
        stage may have seen a new instance first)."""
        p = self.get(addr)
        if p is None and not self._source.static:
            await self.refresh()
            p = self.get(addr)
        return p

    # ---- the list of instances ---------------------------------------------------------------
    async def refresh(self) -> None:
        """Look the addresses up now and apply the list (one look-up at a time)."""
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:
            self._apply(await self._source.resolve())

    def _apply(self, addrs: Sequence[str]) -> None:
        for a in addrs:
            if a in self._peers:
                continue
            back = self._retired.pop(a, None)
            self._peers[a] = back or self._new_peer(a, up=False)  # a candidate once a poll says SERVING
            log.info("%s instance %s %s", self.service or "peer", a, "is listed again" if back else "added")
        for a in [a for a in self._peers if a not in addrs]:
            self._retired[a] = self._peers.pop(a)
            log.info("%s instance %s removed; it gets no new calls", self.service or "peer", a)

    async def _close_retired(self) -> None:
        for a in [a for a, p in self._retired.items() if p.outstanding <= 0 and p.gone]:
            p = self._retired.pop(a)
            await p.channel.close()
            log.info("closed the channel to %s", a)
            if self._on_closed is not None:
                await self._on_closed(a)

    # ---- polling -------------------------------------------------------------------------
    def start(self) -> None:
        """Begin polling (call from the running event loop; idempotent)."""
        if self._task is None and (self._peers or not self._source.static):
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            self._polled.set()
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> None:
        """One round of the poll: look the addresses up again when due, ask every instance
        for its health and load, close the channels of removed ones with no call open."""
        if self._source.due():
            await self.refresh()
        await asyncio.gather(*(self._poll(p) for p in [*self._peers.values(), *self._retired.values()]))
        await self._close_retired()

    async def _poll(self, p: Peer) -> None:
        timeout = max(1.0, 4 * self.poll_s)
        try:
            h = await p.health_stub.Check(health_pb2.HealthCheckRequest(service=self.service), timeout=timeout)
            load = await p.load_stub.Load(stage_pb2.LoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            # refused or reset: down now; silent: a process busy on 2 cores can miss one
            # deadline (its cached media would be routed away from it), a stalled one misses several
            p.timeouts += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if p.up and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and p.timeouts < DOWN_AFTER_TIMEOUTS:
                log.info("%s did not answer its poll within %.1f s (%d in a row)", p.addr, timeout, p.timeouts)
                return
            if p.up:
                log.warning("%s is down (%s)", p.addr, e.code().name)
            p.up, p.gone = False, True
            return
        p.gone, p.timeouts = False, 0
        serving = h.status == health_pb2.HealthCheckResponse.SERVING
        if p.up != serving:
            log.info("%s is %s", p.addr, "serving" if serving else "not serving")
        p.up, p.reported, p.capacity = serving, load.inflight, load.max_inflight
        p.node, p.sent_since_poll, p.polled_at = NodeIdentity.from_proto(load.node), 0, time.monotonic()
        p.queued, p.kv_free_tokens, p.busy_s = load.queued, load.kv_free_tokens, load.busy_s
        p.overdue = min(load.overdue, load.queued)
        p.recent_batch_s, p.recent_batch_size = load.recent_batch_s, load.recent_batch_size

    async def node_of(self, addr: str, timeout: float = 5.0) -> NodeIdentity | None:
        """The instance's node identity (asks it once if no poll has answered yet)."""
        p = self.get(addr)
        if p is None:
            return None
        if p.node is None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                load = await p.load_stub.Load(stage_pb2.LoadRequest(), timeout=timeout)
                p.node = NodeIdentity.from_proto(load.node)
        return p.node

    async def shm_shared(self, addr: str, timeout: float = 5.0) -> bool:
        """Can the instance read shared memory this process writes? (Tried with a probe.)"""
        p = self.get(addr)
        if p is None:
            return False
        with shm_probe() as (name, token):
            if name is None:
                return False
            try:
                r = await p.load_stub.ShmProbe(stage_pb2.ShmProbeRequest(name=name, token=token), timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
        return r.readable

    async def reach_of(self, addr: str, ready_s: float = READY_S) -> tuple[NodeIdentity | None, bool]:
        """(node identity, shares our /dev/shm) of an instance, for the transport choice.
        Waits up to `ready_s` for our channel to it to connect first: another stage may hand
        us an instance (a decode reservation) that this process's channel still sees in
        reconnect backoff from before the instance listened (gRPC waits ~1 s to retry)."""
        await self.connected(addr, ready_s)
        return await self.node_of(addr), await self.shm_shared(addr)

    async def connected(self, addr: str, ready_s: float = READY_S) -> bool:
        """Wait up to `ready_s` for our channel to `addr` to connect; whether it did. A call
        made on a channel still in reconnect backoff fails at once with the old error."""
        p = self.get(addr)
        return p is not None and await connected(p.channel, ready_s)

    # ---- placement -------------------------------------------------------------------------
    def pick(self, exclude: frozenset[str] = frozenset(), prefer: str | None = None) -> Peer:
        """The least-loaded instance that is up; `prefer` wins when it is up (a request
        pinned to one process, e.g. a monolith holding its reservation)."""
        p = self._peers.get(prefer) if prefer else None
        if p is not None and p.up and prefer not in exclude:
            return p
        key = self._policy.choose([p.candidate() for p in self._peers.values()], exclude)
        if key is None:
            left = self.untried(exclude)
            if not self._peers:
                raise Unavailable(f"no {self.service or 'peer'} instance is listed now "
                                  f"(addresses: {', '.join(self._source.configured) or 'none'})")
            if not left:
                raise Unavailable(f"no {self.service or 'peer'} instance left to try ({', '.join(self._peers)})")
            raise Unavailable(f"every {self.service or 'peer'} instance is down or not serving: {', '.join(left)}")
        return self._peers[key]

    async def _pick_soon(self, exclude: frozenset[str], prefer: str | None, wait_s: float = 3.0) -> Peer:
        """`pick`, waiting a few polls for an instance to come (back) up before giving up:
        a peer that is starting or restarting is not an outage."""
        end = time.monotonic() + wait_s
        while True:
            try:
                return self.pick(exclude, prefer)
            except Unavailable:
                tried_all = bool(self._peers) and not self.untried(exclude)
                if time.monotonic() >= end or self._task is None or tried_all:
                    raise
                await asyncio.sleep(self.poll_s)

    async def start_call(self, open_call: Callable[[Peer], object | Awaitable[object]], prefer: str | None = None,
                         failed: set[str] | None = None, retries: int = 1) -> tuple[Peer, object, object]:
        """Open a server-streaming call on the least-loaded instance and read its first
        message; if the call fails before that with UNAVAILABLE (a CANCELLED from the
        instance is one: it stopped with the call open) / RESOURCE_EXHAUSTED, try up to
        `retries` more times on other instances (not for MessageTooLarge: a message
        over the size limit is refused everywhere). `failed`: instances not to use (a
        caller's earlier attempts), given to be filled with each instance that failed so;
        a caller whose retry needs more than a new instance passes `retries=0` and retries
        itself. `open_call(peer)` returns the call, or an awaitable of it. Returns (peer, call,
        first message); the caller must `finish(peer)` when done with the call."""
        failed = set() if failed is None else failed
        tries = 0
        while True:
            peer = await self._pick_soon(frozenset(failed), prefer)
            peer.outstanding += 1
            peer.sent_since_poll += 1
            try:
                call = open_call(peer)
                if inspect.isawaitable(call):  # it first hands the instance something (embeddings)
                    call = await call
            except BaseException:
                peer.outstanding -= 1
                raise
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                peer.outstanding -= 1
                err = from_peer_error(e)
                if isinstance(err, Unavailable):
                    peer.up = False
                retryable = isinstance(err, (Unavailable, Overloaded))  # not MessageTooLarge: an InvalidRequest
                if retryable:
                    failed.add(peer.addr)
                tries += 1
                others = self.untried(failed)  # now: it may have left the list meanwhile
                if retryable and tries <= retries and others:
                    log.info("%s refused a call (%s); retrying on another instance", peer.addr, e.code().name)
                    continue
                raise err.where(f"{self.service or 'peer'} at {peer.addr}") from None
            except BaseException:
                peer.outstanding -= 1
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                peer.outstanding -= 1
                raise Unavailable(f"{peer.addr} closed the stream without answering")
            return peer, call, first

    @staticmethod
    def finish(peer: Peer) -> None:
        peer.outstanding -= 1

    async def close(self) -> None:
        await self.stop()
        await asyncio.gather(*(p.channel.close() for p in [*self._peers.values(), *self._retired.values()]),
                             return_exceptions=True)


def peers_of(cfg, role: str, stub_cls, channel_options, service: str, **kw) -> Peers:
    """The instances a stage config's --<role> flag (and its --peers-file) names, followed
    as they come and go (`cfg` has easerve.stages.common.configs.PeerFields)."""
    source = PeerSource(getattr(cfg, role), role, cfg.peers_file, cfg.peer_refresh_s)
    return Peers(stub_cls, (), channel_options, service=service, source=source, **kw)


async def relay(call) -> AsyncIterator:
    """Yield a streaming call's (remaining) messages; its failure becomes the matching
    domain error, and leaving early (client cancel, deadline) cancels it downstream.
    Reads with `call.read()`, so it may follow a `read()` of the first message."""
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            yield msg
    except grpc.aio.AioRpcError as e:
        raise from_peer_error(e) from None
    finally:
        call.cancel()
