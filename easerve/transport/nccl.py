"""Cross-GPU / cross-node transport: send/recv between the two ranks of a pair's process group.

Each (prefill instance, decode instance) pair has its own 2-rank group (rank 0 sends, rank 1
receives), a `torch.distributed` ProcessGroup object built over a store (never the
process-wide default group, so one process can be in many pairs; `nccl_pairs` forms them).
Order-independent by design: the sender's one worker thread sends, per payload,
[tag, header length] then the header bytes then each tensor; the receiver's one thread
drains that stream as it comes, rebuilds each payload from its codec header and parks it
under its tag. `recv(handle)` picks the payload by the tag in the handle, so requests may be
received in any order, and a payload nobody asks for expires instead of blocking the pipe.
Every send and receive waits at most its timeout; a peer that dies fails them (UNAVAILABLE).
Shutdown: the sender's close() sends tag 0 ("goodbye"), which ends the receiver's thread.
backend="gloo" runs the same code on CPU (tests, CPU stages); "nccl" needs CUDA tensors.
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

from easerve.wire import codec
from easerve.errors import DeadlineExceeded, NotFound, Unavailable
from easerve.transport.base import KVTransport
from easerve.transport.handles import Handle, NcclHandle

log = logging.getLogger(__name__)
SRC, DST = 0, 1  # a pair's ranks: prefill sends, decode receives
IDLE = timedelta(days=365)  # the receiver's wait for the next payload (a dead peer still ends it)


@dataclass(frozen=True)
class NcclConfig:
    rank: int  # this process: SRC (sends) or DST (receives)
    init_method: str = ""  # "tcp://host:port" (rank 0 listens there); "" when the group is given
    backend: str = "nccl"  # or "gloo" (CPU)
    device: str = "cuda:0"  # "cpu" with gloo
    pair: str = ""  # the pair's name, carried in every handle (a decode instance has many pairs)
    connect_timeout_s: float = 120.0
    send_timeout_s: float = 60.0
    park_ttl_s: float = 120.0
    recv_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.rank not in (SRC, DST):
            raise ValueError(f"rank must be {SRC} (sender) or {DST} (receiver), got {self.rank}")
        if self.init_method and not self.init_method.startswith("tcp://"):
            raise ValueError(f"init_method must be tcp://host:port, got {self.init_method!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend 'nccl' needs a cuda device, got device={self.device!r}")

    @property
    def is_sender(self) -> bool:
        return self.rank == SRC


def pair_group(store: Any, rank: int, backend: str, device: str, timeout_s: float) -> Any:
    """A 2-rank ProcessGroup over `store` (both ranks call it; it returns once both joined).
    Every transfer waits with its own timeout; NCCL's group-wide one (its watchdog aborts the
    process past it) is set far out, since the receiver's posted receive idles between payloads."""
    import torch.distributed as dist
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    torch.cuda.set_device(torch.device(device))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = IDLE
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def tcp_store(init_method: str, master: bool, timeout_s: float) -> Any:
    import torch.distributed as dist
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class NcclTransport(KVTransport):
    """`group`: the pair's ProcessGroup (or a stand-in with send/recv returning works that
    `wait(timeout)`); None: formed by `connect()` from `config.init_method`. `completed`: blocks
    until the sends issued so far finished on the device (default: CUDA stream synchronize);
    GB/s is measured after it."""
    name = "nccl"

    def __init__(self, config: NcclConfig, *, group: Any = None,
                 completed: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(config.device)
        self._pg = group
        self._completed = completed if completed is not None else self._device_sync
        self._tags = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="easerve-nccl")
        self._parked: dict[int, tuple[float, bytes, list[torch.Tensor]]] = {}
        self._arrived = threading.Condition()
        self._drainer: threading.Thread | None = None
        self._stopped: str | None = None  # why the pair broke: every transfer then fails at once

    async def connect(self) -> None:
        """Join the pair's group (both ranks must call it, unless it was given); start receiving."""
        if self._pg is None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._init)
        self.start()

    def start(self) -> None:
        if not self.config.is_sender and self._drainer is None:
            self._drainer = threading.Thread(target=self._drain, name="easerve-nccl-recv", daemon=True)
            self._drainer.start()

    def _init(self) -> None:
        c = self.config
        store = tcp_store(c.init_method, c.rank == SRC, c.connect_timeout_s)
        self._pg = pair_group(store, c.rank, c.backend, c.device, c.connect_timeout_s)

    def _device_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _xfer(self, op: str, t: torch.Tensor, timeout_s: float) -> None:
        peer = DST if op == "send" else SRC
        getattr(self._pg, op)([t], peer, 0).wait(timedelta(seconds=timeout_s))

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> NcclHandle:
        if not self.config.is_sender:
            raise ValueError(f"rank {self.config.rank} is the receiving end of this pair")
        if self._stopped:
            raise Unavailable(f"NCCL pair {self.config.pair!r} is broken ({self._stopped})")
        codec.check_parts(header, tensors)
        t0, tag = time.perf_counter(), next(self._tags)
        wait_s = min(timeout or self.config.send_timeout_s, self.config.send_timeout_s)
        loop = asyncio.get_running_loop()
        try:
            nbytes = await loop.run_in_executor(self._pool, self._send_blocking, tag, header, list(tensors), wait_s)
        except RuntimeError as e:  # gloo/NCCL: the peer closed, or the wait timed out
            self._stopped = f"{type(e).__name__}: {e}"
            raise Unavailable(f"KV send over NCCL pair {self.config.pair!r} failed: {e}") from None
        self._measured(nbytes, t0)
        return NcclHandle(request_id, SRC, DST, tag, nbytes, self.config.pair)

    def _send_blocking(self, tag: int, header: bytes, tensors: list[torch.Tensor], wait_s: float) -> int:
        self._xfer("send", torch.tensor([tag, len(header)], dtype=torch.int64, device=self.device), wait_s)
        self._xfer("send", torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), wait_s)
        nbytes = 0
        for t in tensors:
            t = t.detach().to(self.device).contiguous()
            if t.numel():
                self._xfer("send", t.reshape(-1), wait_s)
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
                log.warning("NCCL pair %r: receive thread ended: %s", self.config.pair, e)
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

    @property
    def stopped(self) -> str | None:
        return self._stopped

    def _recv_one(self) -> tuple[int, bytes, list[torch.Tensor]] | None:
        wait_s = self.config.send_timeout_s  # once a payload began, the rest follows at once
        meta = torch.empty(2, dtype=torch.int64, device=self.device)
        self._pg.recv([meta], SRC, 0).wait(IDLE)
        tag, hlen = (int(x) for x in meta.tolist())
        if tag == 0:
            return None
        hbuf = torch.empty(hlen, dtype=torch.uint8, device=self.device)
        self._xfer("recv", hbuf, wait_s)
        header = bytes(hbuf.cpu().numpy())
        tensors = []
        for spec in codec.parse_header(header)[2]:
            t = torch.empty(spec.shape, dtype=codec.DTYPES[spec.dtype], device=self.device)
            if t.numel():
                self._xfer("recv", t.reshape(-1), wait_s)
            tensors.append(t)
        self._device_sync()  # consumers may run on other streams / threads
        return tag, header, tensors

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, NcclHandle)
        c = self.config
        if (handle.src_rank, handle.dst_rank) != (SRC, DST) or c.is_sender or handle.pair != c.pair:
            raise NotFound(f"handle for pair {handle.pair!r} ranks {handle.src_rank}->{handle.dst_rank} reached "
                           f"rank {c.rank} of pair {c.pair!r}")
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
        """Sender: say goodbye (the receiver's thread ends on it). Receiver: wait up to
        drain_timeout_s for the goodbye. The group itself goes with this object."""
        loop = asyncio.get_running_loop()
        if self._pg is not None and self.config.is_sender and not self._stopped:
            goodbye = torch.zeros(2, dtype=torch.int64, device=self.device)
            try:
                await loop.run_in_executor(self._pool, self._xfer, "send", goodbye, drain_timeout_s)
            except RuntimeError as e:
                log.info("NCCL pair %r: goodbye not delivered (%s)", self.config.pair, e)
        if self._drainer is not None:
            await asyncio.to_thread(self._drainer.join, drain_timeout_s)
        with self._arrived:
            self._parked.clear()
        self._pool.shutdown(wait=False)
