"""Cross-GPU / cross-node transport: torch.distributed send/recv between a fixed pair of ranks.

The pair shares one process group, initialised over TCP (`init_method="tcp://host:port"`).
Order-independent by design: the sender's one worker thread sends, per payload,
[tag, header length] then the header bytes then each tensor; the receiver's one thread
drains that stream as it comes, rebuilds each payload from its codec header and parks it
under its tag. `recv(handle)` picks the payload by the tag in the handle, so requests may be
received in any order, and a payload nobody asks for expires instead of blocking the pipe.
Shutdown: the sender's close() sends tag 0 ("goodbye"), which ends the receiver's thread;
the receiver's close() waits for it before tearing the group down.
backend="gloo" runs the same code on CPU (tests); "nccl" needs CUDA tensors.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from easerve.wire import codec
from easerve.errors import DeadlineExceeded, NotFound, Unavailable
from easerve.transport.base import KVTransport
from easerve.transport.handles import Handle, NcclHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NcclConfig:
    rank: int  # this process: src_rank (sends) or dst_rank (receives)
    init_method: str  # "tcp://host:port" both ranks agree on
    src_rank: int = 0
    dst_rank: int = 1
    backend: str = "nccl"  # or "gloo" (CPU)
    device: str = "cuda:0"  # "cpu" with gloo
    connect_timeout_s: float = 120.0
    park_ttl_s: float = 120.0
    recv_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.rank not in (self.src_rank, self.dst_rank) or self.src_rank == self.dst_rank:
            raise ValueError(f"rank {self.rank} must be one of two distinct ranks "
                             f"src_rank={self.src_rank} / dst_rank={self.dst_rank}")
        if not self.init_method.startswith(("tcp://", "file://", "env://")):
            raise ValueError(f"init_method must be tcp://host:port (or file://, env://), got {self.init_method!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend 'nccl' needs a cuda device, got device={self.device!r}")

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src_rank


class NcclTransport(KVTransport):
    """`comm`: the torch.distributed module (or a stand-in with its send/recv/init calls);
    `completed`: blocks until the sends issued so far have finished on the device (default:
    on CUDA, synchronize the sending thread's current stream, which NCCL's sends were ordered
    before; on CPU nothing, gloo's send returns when done). GB/s is measured after it."""
    name = "nccl"

    def __init__(self, config: NcclConfig, *, comm: Any = None,
                 completed: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(config.device)
        self._dist = dist if comm is None else comm
        self._completed = completed if completed is not None else self._default_completed
        self._tags = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="easerve-nccl")
        self._parked: dict[int, tuple[float, bytes, list[torch.Tensor]]] = {}
        self._arrived = threading.Condition()
        self._drainer: threading.Thread | None = None
        self._stopped: str | None = None  # why the receive thread ended: every recv then fails at once

    async def connect(self) -> None:
        """Join the pair's process group (both ranks must call it); start receiving."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._init)
        if not self.config.is_sender:
            self._drainer = threading.Thread(target=self._drain, name="easerve-nccl-recv", daemon=True)
            self._drainer.start()

    def _default_completed(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _init(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        c = self.config
        self._dist.init_process_group(c.backend, init_method=c.init_method, rank=c.rank, world_size=2,
                                timeout=timedelta(seconds=c.connect_timeout_s))

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> NcclHandle:
        if not self.config.is_sender:
            raise ValueError(f"rank {self.config.rank} is the receiving end of this pair")
        codec.check_parts(header, tensors)
        t0, tag = time.perf_counter(), next(self._tags)
        loop = asyncio.get_running_loop()
        nbytes = await loop.run_in_executor(self._pool, self._send_blocking, tag, header, list(tensors))
        self._measured(nbytes, t0)
        return NcclHandle(request_id, self.config.src_rank, self.config.dst_rank, tag, nbytes)

    def _send_blocking(self, tag: int, header: bytes, tensors: list[torch.Tensor]) -> int:
        peer, send = self.config.dst_rank, self._dist.send
        send(torch.tensor([tag, len(header)], dtype=torch.int64, device=self.device), dst=peer)
        send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), dst=peer)
        nbytes = 0
        for t in tensors:
            t = t.detach().to(self.device).contiguous()
            if t.numel():
                send(t.reshape(-1), dst=peer)
            nbytes += t.numel() * t.element_size()
        self._completed()  # NCCL's sends are queued on the device: the transfer ends here
        return nbytes

    def _drain(self) -> None:
        """Receiver thread: take payloads off the pair's stream in order and park them."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            try:
                got = self._recv_one()
            except Exception as e:  # noqa: BLE001 - the peer died or the stream broke: fail every transfer
                log.error("NCCL receive thread of pair %d->%d died", self.config.src_rank, self.config.dst_rank,
                          exc_info=e)
                return self._stop(f"it died: {type(e).__name__}: {e}")
            if got is None:  # goodbye
                return self._stop("the sender closed the pair")
            tag, header, tensors = got
            with self._arrived:
                self._parked[tag] = (time.monotonic() + self.config.park_ttl_s, header, tensors)
                self._arrived.notify_all()

    def _stop(self, why: str) -> None:
        with self._arrived:
            self._stopped = why
            self._arrived.notify_all()

    def _recv_one(self) -> tuple[int, bytes, list[torch.Tensor]] | None:
        src = self.config.src_rank
        meta = torch.empty(2, dtype=torch.int64, device=self.device)
        recv = self._dist.recv
        recv(meta, src=src)
        tag, hlen = (int(x) for x in meta.tolist())
        if tag == 0:
            return None
        hbuf = torch.empty(hlen, dtype=torch.uint8, device=self.device)
        recv(hbuf, src=src)
        header = bytes(hbuf.cpu().numpy())
        tensors = []
        for spec in codec.parse_header(header)[2]:
            t = torch.empty(spec.shape, dtype=codec.DTYPES[spec.dtype], device=self.device)
            if t.numel():
                recv(t.reshape(-1), src=src)
            tensors.append(t)
        if self.device.type == "cuda":  # consumers may run on other streams / threads
            torch.cuda.current_stream(self.device).synchronize()
        return tag, header, tensors

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, NcclHandle)
        c = self.config
        if (handle.src_rank, handle.dst_rank) != (c.src_rank, c.dst_rank) or c.is_sender:
            raise NotFound(f"handle for ranks {handle.src_rank}->{handle.dst_rank} reached rank {c.rank} "
                           f"of pair {c.src_rank}->{c.dst_rank}")
        t0 = time.perf_counter()
        wait_s = timeout or c.recv_timeout_s
        header, tensors = await asyncio.to_thread(self._take, handle.tag, wait_s)
        self._measured(handle.nbytes, t0)
        return header, tensors

    def _take(self, tag: int, wait_s: float) -> tuple[bytes, list[torch.Tensor]]:
        with self._arrived:
            self._sweep()
            if not self._arrived.wait_for(lambda: tag in self._parked or self._stopped, timeout=wait_s):
                raise DeadlineExceeded(f"no payload with tag {tag} arrived within {wait_s:.1f}s")
            if tag not in self._parked:
                raise Unavailable(f"payload {tag} cannot arrive: this pair's receive thread stopped ({self._stopped})")
            _, header, tensors = self._parked.pop(tag)
        return header, tensors

    def release(self, handle: Handle) -> None:
        if isinstance(handle, NcclHandle):
            with self._arrived:
                self._parked.pop(handle.tag, None)

    def _sweep(self) -> None:
        now = time.monotonic()
        for tag, (expiry, _, _) in list(self._parked.items()):
            if expiry <= now:
                del self._parked[tag]

    async def close(self, *, drain_timeout_s: float = 30.0) -> None:
        """Sender: say goodbye, then leave the group. Receiver: wait (up to drain_timeout_s)
        for the goodbye, then leave; if it never comes the group is left to process exit."""
        loop = asyncio.get_running_loop()
        if self._dist.is_initialized() and self.config.is_sender:
            goodbye = torch.zeros(2, dtype=torch.int64, device=self.device)
            await loop.run_in_executor(self._pool, lambda: self._dist.send(goodbye, dst=self.config.dst_rank))
        if self._drainer is not None:
            await asyncio.to_thread(self._drainer.join, drain_timeout_s)
        with self._arrived:
            self._parked.clear()
        if self._dist.is_initialized() and (self._drainer is None or not self._drainer.is_alive()):
            await loop.run_in_executor(self._pool, self._dist.destroy_process_group)
        self._pool.shutdown(wait=False)
