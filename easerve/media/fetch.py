"""Fetching media by URL for the gateway, without letting it reach what it should not.

- `http(s)://`: only hosts in `allowed_domains` when that list is set (exact names, or
  `*.example.com` for subdomains); every address a host resolves to must be public
  (not private, loopback, link-local, multicast, reserved or unspecified) unless that host
  is listed explicitly. The check runs for every redirect hop, and again inside the
  connector when it connects (so a name re-resolving to a private address is refused too).
  Bodies are capped at `max_bytes` (Content-Length and the bytes actually read), the whole
  fetch, redirects included, at `timeout_s`, redirects at `max_redirects`.
- `file://`: only below `allowed_local_path`, after resolving symlinks and `..`.

Every refusal is a `MediaError` naming the URL and the flag to change.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from easerve.errors import MediaError

REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class FetchConfig:
    allowed_domains: tuple[str, ...] = ()   # empty: any public host
    allowed_local_path: str | None = None   # None: file:// refused
    max_bytes: int = 64 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"--media-max-mb must be > 0, got {self.max_bytes} bytes")
        if not self.timeout_s > 0:
            raise ValueError(f"--media-timeout-s must be > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        object.__setattr__(self, "allowed_domains", tuple(d.strip().lower().rstrip(".")
                                                          for d in self.allowed_domains if d.strip()))
        if self.allowed_local_path is not None and not Path(self.allowed_local_path).is_dir():
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_path!r} is not a directory")

    def host_listed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in self.allowed_domains)


def _public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                or addr.is_reserved or addr.is_unspecified)


class _Refused(OSError):
    """Raised inside the connector's resolver; unwrapped into a MediaError by the fetcher."""


class MediaFetcher:
    """`await fetch(url) -> bytes` under a `FetchConfig`."""

    def __init__(self, cfg: FetchConfig):
        self.cfg = cfg

    async def fetch(self, url: str) -> bytes:
        url = url.strip()
        scheme = urlsplit(url).scheme.lower()
        if scheme == "file":
            return await asyncio.to_thread(self._read_local, url)
        if scheme not in ("http", "https"):
            raise MediaError(f"media URL scheme {scheme!r} is not fetched; use http(s)://, file:// or a data: URI")
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self._fetch_http(url)
        except TimeoutError:
            raise MediaError(f"fetching {url} took longer than {self.cfg.timeout_s:g} s (--media-timeout-s); "
                             "send the media inline or from a faster host") from None

    # ---- http(s) --------------------------------------------------------------------------
    async def _check_host(self, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname
        if not host:
            raise MediaError(f"media URL {url!r} has no host")
        listed = self.cfg.host_listed(host)
        if self.cfg.allowed_domains and not listed:
            raise MediaError(f"media host {host!r} is not in --allowed-media-domains "
                             f"({', '.join(self.cfg.allowed_domains)}); add it there or send the media inline")
        if not listed:
            for ip in await self._resolve(host, parts.port):
                if not _public(ip):
                    raise MediaError(f"media host {host!r} resolves to the non-public address {ip}; such hosts are "
                                     "refused unless listed in --allowed-media-domains")

    @staticmethod
    async def _resolve(host: str, port: int | None) -> list[str]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise MediaError(f"media host {host!r} cannot be resolved ({e.strerror})") from None
        return [info[4][0] for info in infos]

    def _connector(self):
        import aiohttp
        from aiohttp.resolver import ThreadedResolver

        cfg = self.cfg

        class CheckedResolver(ThreadedResolver):
            async def resolve(self, host, port=0, family=socket.AF_INET):
                found = await super().resolve(host, port, family)
                if not cfg.host_listed(host):
                    bad = [r["host"] for r in found if not _public(r["host"])]
                    if bad:
                        raise _Refused(f"media host {host!r} resolves to the non-public address {bad[0]}; such "
                                       "hosts are refused unless listed in --allowed-media-domains")
                return found

        return aiohttp.TCPConnector(resolver=CheckedResolver(), use_dns_cache=False, limit=4)

    async def _fetch_http(self, url: str) -> bytes:
        import aiohttp

        async with aiohttp.ClientSession(connector=self._connector(), trust_env=False) as session:
            for _hop in range(self.cfg.max_redirects + 1):
                await self._check_host(url)
                try:
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status in REDIRECTS and "Location" in resp.headers:
                            url = self._next_hop(url, resp.headers["Location"])
                            continue
                        return await self._body(url, resp)
                except aiohttp.ClientConnectorError as e:
                    if isinstance(e.os_error, _Refused):
                        raise MediaError(str(e.os_error)) from None
                    raise MediaError(f"media URL {url} could not be fetched ({e.os_error})") from None
                except aiohttp.ClientError as e:
                    raise MediaError(f"media URL {url} could not be fetched ({type(e).__name__}: {e})") from None
        raise MediaError(f"media URL redirected more than {self.cfg.max_redirects} times; send the final URL")

    @staticmethod
    def _next_hop(url: str, location: str) -> str:
        nxt = urljoin(url, location)
        if urlsplit(nxt).scheme.lower() not in ("http", "https"):
            raise MediaError(f"media URL {url} redirects to {nxt!r}; only http(s) redirects are followed")
        return nxt

    async def _body(self, url: str, resp) -> bytes:
        if resp.status != 200:
            raise MediaError(f"media URL {url} answered HTTP {resp.status}; send a URL that serves the file")
        cap = self.cfg.max_bytes
        if resp.content_length is not None and resp.content_length > cap:
            raise MediaError(f"media at {url} is {resp.content_length} bytes; at most {cap} are fetched "
                             "(--media-max-mb)")
        buf = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            buf += chunk
            if len(buf) > cap:
                raise MediaError(f"media at {url} is over {cap} bytes; at most {cap} are fetched (--media-max-mb)")
        return bytes(buf)

    # ---- file:// ----------------------------------------------------------------------------
    def _read_local(self, url: str) -> bytes:
        root = self.cfg.allowed_local_path
        if root is None:
            raise MediaError("file:// media URLs are refused; start the gateway with --allowed-local-media-path "
                             "DIR to serve files below DIR, or send the media inline")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file:// URL {url!r} names host {parts.netloc!r}; use file:///absolute/path")
        raw_path = unquote(parts.path)
        if ".." in Path(raw_path).parts:
            raise MediaError(f"file:// URL {url!r} contains '..'; give the path below {root} directly")
        base = Path(root).resolve()
        try:
            path = Path(raw_path).resolve(strict=True)
        except (OSError, RuntimeError):
            raise MediaError(f"file {raw_path!r} does not exist") from None
        if not path.is_relative_to(base):
            raise MediaError(f"file {raw_path!r} is outside --allowed-local-media-path {root}; "
                             "move it there or send it inline")
        if not path.is_file():
            raise MediaError(f"file {raw_path!r} is not a regular file")
        size = os.path.getsize(path)
        if size > self.cfg.max_bytes:
            raise MediaError(f"file {raw_path!r} is {size} bytes; at most {self.cfg.max_bytes} are read "
                             "(--media-max-mb)")
        return path.read_bytes()
