"""Where a stage's peer addresses come from, and how they are looked up again while it runs.

A stage is given, per peer role (--decode, --prefill, --encode), a list of `host:port`:
- an IP literal (`127.0.0.1:50053`, `[::1]:50053`) is one instance;
- a host name is every address it resolves to (A and AAAA records), looked up again every
  --peer-refresh-s: a Kubernetes headless Service (or a compose service scaled to several
  containers) names each ready instance, so instances that come and go are followed;
- with --peers-file, the launcher's list: a JSON object `{"decode": ["host:port", ...], ...}`
  that the launcher replaces atomically (write + rename) when it adds or removes an
  instance; a role the file names replaces that role's command-line list. The file is
  read again whenever its identity (inode, size, mtime) changes.

`PeerSource.due()` says whether a look-up is due (pure, injected clock); `resolve()` runs
the DNS look-ups in a thread, off the event loop. A name that does not resolve keeps the
addresses it had (a DNS hiccup is not an outage); a broken peers file keeps the last good one.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)
Getaddrinfo = Callable[..., list]


def split_hostport(addr: str) -> tuple[str, int]:
    """('host', port) of 'host:port' or '[v6]:port'; ValueError saying what is wrong."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {addr!r} must be host:port (port 1..65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_addr(addr: str, getaddrinfo: Getaddrinfo = socket.getaddrinfo) -> list[str]:
    """Every `ip:port` that `addr` names, in the resolver's order, without repeats (blocking;
    socket.gaierror when the name does not resolve)."""
    host, port = split_hostport(addr)
    if is_ip(host):
        return [join_hostport(host, port)]
    out: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in getaddrinfo(host, port, type=socket.SOCK_STREAM):
        a = join_hostport(sockaddr[0], port)
        if a not in out:
            out.append(a)
    return out


class PeersFile:
    """The launcher's list of peers, read again when the file changes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._seen: tuple | None = None

    def _identity(self) -> tuple | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> bool:
        """Whether the file differs from the one `read()` last returned (appeared, replaced, gone)."""
        return self._identity() != self._seen

    def read(self) -> dict[str, tuple[str, ...]] | None:
        """role -> addresses, or None when there is no file; ValueError when it is malformed."""
        ident = self._identity()
        if ident is None:
            self._seen = None
            return None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"peers file {self.path}: {e}") from None
        self._seen = ident
        return parse_peers(data, str(self.path))


def parse_peers(data, where: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a JSON object of role -> [\"host:port\", ...], got {type(data).__name__}")
    out = {}
    for role, addrs in data.items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise ValueError(f"{where}: {role!r} must be a list of \"host:port\" strings, got {addrs!r}")
        for a in addrs:
            split_hostport(a)
        out[str(role)] = tuple(addrs)
    return out


def write_peers_file(path: str | os.PathLike, peers: dict[str, Sequence[str]]) -> None:
    """Replace the file atomically (write a temporary file, then rename over it): a reader
    sees the old list or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({role: list(addrs) for role, addrs in peers.items()}, indent=1))
    os.replace(tmp, path)


class PeerSource:
    """The addresses of one role's instances, from the command line, DNS and the peers file."""

    def __init__(self, addrs: Sequence[str], role: str = "", peers_file: str = "", refresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, getaddrinfo: Getaddrinfo = socket.getaddrinfo):
        if refresh_s <= 0:
            raise ValueError(f"refresh_s (--peer-refresh-s) must be > 0, got {refresh_s}")
        for a in addrs:
            split_hostport(a)
        self.flag_addrs, self.role, self.refresh_s = tuple(addrs), role, refresh_s
        self.file = PeersFile(peers_file) if peers_file else None
        self._file_addrs: tuple[str, ...] | None = None
        self._clock, self._getaddrinfo = clock, getaddrinfo
        self._next_dns: float | None = None   # None: never resolved
        self._last: dict[str, list[str]] = {}  # name -> what it resolved to last

    @property
    def configured(self) -> tuple[str, ...]:
        """The addresses as given (names unresolved): the file's for this role, else the flag's."""
        return self._file_addrs if self._file_addrs is not None else self.flag_addrs

    @property
    def static(self) -> bool:
        """Whether nothing here can change while running (IP literals, no peers file)."""
        return self.file is None and all(is_ip(split_hostport(a)[0]) for a in self.flag_addrs)

    def static_addrs(self) -> list[str]:
        """The instances of a static source, known without a look-up."""
        return [resolve_addr(a)[0] for a in self.flag_addrs]

    def due(self) -> bool:
        """Whether `resolve()` may give something new: never resolved, the peers file changed,
        or a name's re-resolution time has come."""
        if self._next_dns is None:
            return True
        if self.file is not None and self.file.changed():
            return True
        names = any(not is_ip(split_hostport(a)[0]) for a in self.configured)
        return names and self._clock() >= self._next_dns

    async def resolve(self) -> list[str]:
        """Read the peers file if it changed, then resolve every name (in a thread)."""
        self._read_file()
        self._next_dns = self._clock() + self.refresh_s
        configured = self.configured
        looked_up = await asyncio.to_thread(self._resolve_all, configured)
        out: list[str] = []
        for a in configured:
            for ip in looked_up[a]:
                if ip not in out:
                    out.append(ip)
        return out

    def _read_file(self) -> None:
        if self.file is None or not self.file.changed():
            return
        try:
            roles = self.file.read()
        except ValueError as e:
            log.error("%s; keeping the peers it listed before", e)
            return
        self._file_addrs = None if roles is None or self.role not in roles else roles[self.role]

    def _resolve_all(self, addrs: Sequence[str]) -> dict[str, list[str]]:
        out = {}
        for a in addrs:
            try:
                out[a] = self._last[a] = resolve_addr(a, self._getaddrinfo)
            except OSError as e:  # socket.gaierror: keep what it named before
                log.warning("%s does not resolve (%s); keeping its last addresses %s", a, e, self._last.get(a, []))
                out[a] = self._last.get(a, [])
        return out
