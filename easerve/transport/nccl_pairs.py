"""NCCL pair groups between prefill and decode instances, formed as instances come and go.

Every (prefill instance, decode instance) pair has its own 2-rank group: prefill is rank 0
(sends), decode rank 1 (receives), so ranks never depend on how many instances exist. A
decode instance hosts a TCP store (`--kv-rendezvous host:port`; by default its listen host,
any port) and advertises it in its node identity. A prefill instance that hands KV to it
joins the store, names a new pair ("<its host>-<pid>-<random>") under the next number of the
store's `pairs` counter, and both build the pair's group under that name's key prefix. The
backend rides with the name: "nccl" when both ends are on CUDA, "gloo" (CPU tensors)
otherwise. Only the pair's name and backend cross the store, as plain text.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from easerve.errors import NotFound, Unavailable
from easerve.transport.base import KVTransport
from easerve.transport.handles import Handle, NcclHandle
from easerve.transport.nccl import DST, SRC, NcclConfig, NcclTransport, pair_group

log = logging.getLogger(__name__)
_COUNTER, _POLL_S = "pairs", 0.05


def backend_for(sender_device: str, receiver_device: str) -> str:
    """NCCL moves CUDA tensors between two GPUs; any pair with a CPU end uses gloo on CPU."""
    return "nccl" if sender_device.startswith("cuda") and receiver_device.startswith("cuda") else "gloo"


def pair_device(backend: str, device: str) -> str:
    return device if backend == "nccl" else "cpu"


def new_pair_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _announce(name: str, backend: str) -> str:
    if " " in name or backend not in ("nccl", "gloo"):
        raise ValueError(f"bad pair announcement {name!r} {backend!r}")
    return f"{name} {backend}"


def _parse(value: bytes) -> tuple[str, str]:
    name, _, backend = value.decode("ascii").partition(" ")
    if not name or backend not in ("nccl", "gloo"):
        raise ValueError(f"malformed pair announcement {value[:80]!r}")
    return name, backend


@dataclass(frozen=True)
class PairTimeouts:
    connect_s: float = 60.0  # store connection and group formation
    send_s: float = 60.0  # one tensor's send / receive once a payload began
    recv_s: float = 30.0  # decode: wait for a payload whose handle arrived


def _store(host: str, port: int, master: bool, timeout_s: float):
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _prefixed(store, name: str):
    import torch.distributed as dist
    return dist.PrefixStore(f"pair/{name}/", store)


def connect_pair_blocking(rendezvous: str, my_device: str, peer_device: str,
                          t: PairTimeouts = PairTimeouts()) -> NcclTransport:
    """Prefill side: form a new pair with the decode instance whose store is at `rendezvous`."""
    host, port = rendezvous.rsplit(":", 1)
    backend = backend_for(my_device, peer_device)
    name = new_pair_name()
    try:
        store = _store(host, int(port), False, t.connect_s)
        n = store.add(_COUNTER, 1)
        store.set(f"pair/{n}", _announce(name, backend))
        group = pair_group(_prefixed(store, name), SRC, backend, pair_device(backend, my_device), t.connect_s)
    except RuntimeError as e:  # DistStoreError, gloo connect errors
        raise Unavailable(f"cannot form an NCCL pair with the decode instance at {rendezvous}: {e}") from None
    cfg = NcclConfig(rank=SRC, backend=backend, device=pair_device(backend, my_device), pair=name,
                     connect_timeout_s=t.connect_s, send_timeout_s=t.send_s)
    log.info("NCCL pair %s formed with %s (%s)", name, rendezvous, backend)
    return NcclTransport(cfg, group=group)


async def connect_pair(rendezvous: str, my_device: str, peer_device: str,
                       t: PairTimeouts = PairTimeouts()) -> NcclTransport:
    return await asyncio.to_thread(connect_pair_blocking, rendezvous, my_device, peer_device, t)


class PairRendezvous(KVTransport):
    """Decode side: hosts the store, joins every pair a prefill announces (its own thread) and
    receives each handle from the pair it names."""
    name = "nccl"

    def __init__(self, listen: str, device: str, t: PairTimeouts = PairTimeouts()) -> None:
        super().__init__()
        host, port = listen.rsplit(":", 1)
        self.device, self.t = device, t
        self._store = _store(host, int(port), True, t.connect_s)
        self.address = f"{host}:{self._store.port}"
        self.pairs: dict[str, NcclTransport] = {}
        self._closed = threading.Event()
        self._changed = threading.Condition()
        self._acceptor = threading.Thread(target=self._accept, name="easerve-nccl-pairs", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        n = 1
        while not self._closed.is_set():
            if not self._store.check([f"pair/{n}"]):
                time.sleep(_POLL_S)
                continue
            key, n = f"pair/{n}", n + 1
            try:
                name, backend = _parse(self._store.get(key))
                self._store.delete_key(key)
            except (RuntimeError, ValueError) as e:
                log.warning("NCCL pair %s not formed: %s", key, e)
                continue
            threading.Thread(target=self._join, args=(name, backend), daemon=True,
                             name=f"easerve-nccl-join-{n - 1}").start()  # one slow pair blocks no other

    def _join(self, name: str, backend: str) -> None:
        device = pair_device(backend, self.device)
        try:
            group = pair_group(_prefixed(self._store, name), DST, backend, device, self.t.connect_s)
        except RuntimeError as e:  # the prefill died while forming: nothing to keep
            log.warning("NCCL pair %s not formed: %s", name, e)
            return
        cfg = NcclConfig(rank=DST, backend=backend, device=device, pair=name, connect_timeout_s=self.t.connect_s,
                         send_timeout_s=self.t.send_s, recv_timeout_s=self.t.recv_s)
        tr = NcclTransport(cfg, group=group)
        tr.start()
        with self._changed:
            for old, p in list(self.pairs.items()):  # a pair whose sender left is gone
                if p.stopped:
                    del self.pairs[old]
            self.pairs[name] = tr
            self._changed.notify_all()
        log.info("NCCL pair %s joined (%s)", name, backend)

    def _pair(self, name: str, wait_s: float) -> NcclTransport:
        with self._changed:
            if not self._changed.wait_for(lambda: name in self.pairs or self._closed.is_set(), timeout=wait_s):
                raise NotFound(f"NCCL pair {name!r} is not formed with this decode instance")
            if name not in self.pairs:
                raise Unavailable("this decode instance's NCCL rendezvous is closed")
            return self.pairs[name]

    async def send(self, request_id, header, tensors, *, timeout=None):
        raise ValueError("a decode instance's NCCL rendezvous receives only")

    async def recv(self, handle: Handle, *, timeout: float | None = None):
        self._expect(handle, NcclHandle)
        wait_s = timeout or self.t.recv_s
        pair = await asyncio.to_thread(self._pair, handle.pair, wait_s)
        out = await pair.recv(handle, timeout=wait_s)
        self.last_gbps = pair.last_gbps
        return out

    def release(self, handle: Handle) -> None:
        if isinstance(handle, NcclHandle) and handle.pair in self.pairs:
            self.pairs[handle.pair].release(handle)

    async def close(self) -> None:
        self._closed.set()
        with self._changed:
            self._changed.notify_all()
        await asyncio.to_thread(self._acceptor.join, 5.0)
        for p in list(self.pairs.values()):
            await p.close(drain_timeout_s=1.0)
        self.pairs.clear()
