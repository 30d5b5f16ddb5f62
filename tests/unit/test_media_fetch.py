"""MediaFetcher against a real aiohttp server on 127.0.0.1: what is fetched, and what is refused."""
from __future__ import annotations

import asyncio
import io
import os

import pytest
from aiohttp import web
from PIL import Image

from easerve.errors import MediaError
from easerve.media import FetchConfig, MediaConfig, MediaFetcher, MediaResolver
from easerve.types import MediaPart, MediaRef

LOCAL = ("127.0.0.1",)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 10), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


class Server:
    """Routes: /img.png, /big (Content-Length), /stream (no length), /slow, /trickle, /go?to=URL, /loop, /404."""

    def __init__(self):
        self.slow_done = False
        app = web.Application()
        app.add_routes([web.get("/img.png", self.img), web.get("/big", self.big), web.get("/stream", self.stream),
                        web.get("/slow", self.slow), web.get("/trickle", self.trickle), web.get("/go", self.go),
                        web.get("/loop", self.loop), web.get("/tone.flac", self.flac)])
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)

    async def __aenter__(self):
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    async def img(self, _r):
        return web.Response(body=png(), content_type="image/png")

    async def big(self, _r):
        return web.Response(body=b"x" * 5000)

    async def stream(self, r):
        resp = web.StreamResponse()
        await resp.prepare(r)
        for _ in range(10):
            await resp.write(b"y" * 1000)
        return resp

    async def slow(self, _r):
        await asyncio.sleep(30)
        self.slow_done = True
        return web.Response(body=b"late")

    async def trickle(self, r):
        resp = web.StreamResponse()
        resp.content_length = 100
        await resp.prepare(r)
        for _ in range(100):
            await resp.write(b"z")
            await asyncio.sleep(1)
        self.slow_done = True
        return resp

    async def flac(self, _r):
        from tests.models.media_clips import encode_audio, tone

        return web.Response(body=encode_audio(tone(0.5, 44100), "flac"), content_type="audio/flac")

    async def go(self, r):
        raise web.HTTPFound(r.query["to"])

    async def loop(self, _r):
        raise web.HTTPFound("/loop")


def fetch_with_server(path_or_fn, **cfg):
    """Run one fetch against a fresh server; `path_or_fn(base) -> url` builds the URL."""
    async def main():
        async with Server() as srv:
            url = path_or_fn(srv.base) if callable(path_or_fn) else srv.base + path_or_fn
            try:
                return await MediaFetcher(FetchConfig(**cfg)).fetch(url), srv
            except MediaError as e:
                e.server_done = srv.slow_done  # what the server had done when the fetch gave up
                raise
    return asyncio.run(main())


def test_an_explicitly_allowed_host_is_served():
    body, _ = fetch_with_server("/img.png", allowed_domains=LOCAL)
    assert body == png()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.png", "http://localhost:9/x.png", "http://10.1.2.3/x",
                                 "http://169.254.169.254/latest/meta-data/", "http://[::1]:9/x",
                                 "http://[::ffff:127.0.0.1]:9/x", "http://0.0.0.0:9/x", "http://192.168.0.1/x"])
def test_private_loopback_and_link_local_addresses_are_refused_unless_listed(url):
    with pytest.raises(MediaError, match="non-public address.*unless listed in --allowed-media-domains"):
        asyncio.run(MediaFetcher(FetchConfig()).fetch(url))


def test_private_server_is_refused_without_the_allow_list():
    with pytest.raises(MediaError, match="'127.0.0.1' resolves to the non-public address 127.0.0.1"):
        fetch_with_server("/img.png")


def test_hosts_outside_the_allow_list_are_refused():
    with pytest.raises(MediaError, match=r"'127.0.0.1' is not in --allowed-media-domains \(example.com\)"):
        fetch_with_server("/img.png", allowed_domains=("example.com",))


def test_wildcard_entries_match_subdomains_only():
    cfg = FetchConfig(allowed_domains=("*.example.com", "Media.Test."))
    assert cfg.host_listed("a.example.com") and cfg.host_listed("media.test")
    assert not cfg.host_listed("example.com") and not cfg.host_listed("badexample.com")


@pytest.mark.parametrize("path", ["/big", "/stream"])
def test_oversize_bodies_are_refused(path):
    with pytest.raises(MediaError, match="at most 4096 are fetched.*--media-max-mb"):
        fetch_with_server(path, allowed_domains=LOCAL, max_bytes=4096)


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_slow_responses_are_refused_at_the_timeout(path):
    with pytest.raises(MediaError, match=r"took longer than 0.3 s \(--media-timeout-s\)") as e:
        fetch_with_server(path, allowed_domains=LOCAL, timeout_s=0.3)
    assert not e.value.server_done  # refused while the server was still waiting / sending


def test_redirect_to_an_unlisted_host_is_refused():
    with pytest.raises(MediaError, match="'localhost' is not in --allowed-media-domains"):
        fetch_with_server(lambda b: f"{b}/go?to=http://localhost:{b.rsplit(':', 1)[1]}/img.png", allowed_domains=LOCAL)


def test_redirect_to_an_unlisted_private_address_is_refused():
    # without an allow list the first hop (127.0.0.1) is refused already; list it, not the target
    with pytest.raises(MediaError, match="'10.0.0.7' is not in --allowed-media-domains"):
        fetch_with_server(lambda b: f"{b}/go?to=http://10.0.0.7/x", allowed_domains=("127.0.0.1", "*.nothing"))


def test_redirect_within_the_allowed_host_is_followed_and_file_redirects_are_not():
    body, _ = fetch_with_server(lambda b: f"{b}/go?to=/img.png", allowed_domains=LOCAL)
    assert body == png()
    with pytest.raises(MediaError, match="only http\\(s\\) redirects are followed"):
        fetch_with_server(lambda b: f"{b}/go?to=file:///etc/passwd", allowed_domains=LOCAL)


def test_redirect_loops_stop_at_the_limit():
    with pytest.raises(MediaError, match="redirected more than 2 times"):
        fetch_with_server("/loop", allowed_domains=LOCAL, max_redirects=2)


def test_http_errors_name_the_status():
    with pytest.raises(MediaError, match="answered HTTP 404"):
        fetch_with_server("/nothing-here", allowed_domains=LOCAL)


def test_connector_resolver_rechecks_addresses_at_connect_time():
    """Names are re-checked when the connection is made (a name re-resolving to a private address)."""
    async def main():
        conn = MediaFetcher(FetchConfig())._connector()
        try:
            await conn._resolver.resolve("localhost", 80)
        finally:
            await conn.close()
    with pytest.raises(OSError, match="non-public address"):
        asyncio.run(main())


# ---- file:// ------------------------------------------------------------------------------
@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(png())
    (tmp_path / "secret.txt").write_text("no")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    return root


def test_file_urls_are_served_only_below_the_allowed_path(media_dir):
    f = MediaFetcher(FetchConfig(allowed_local_path=str(media_dir)))
    assert asyncio.run(f.fetch(f"file://{media_dir}/sub/cat.png")) == png()
    for url, match in [(f"file://{media_dir.parent}/secret.txt", "outside --allowed-local-media-path"),
                       (f"file://{media_dir}/link.txt", "outside --allowed-local-media-path"),
                       (f"file://{media_dir}/sub/../../secret.txt", "contains '..'"),
                       (f"file://{media_dir}/sub/%2E%2E/%2E%2E/secret.txt", "contains '..'"),
                       (f"file://{media_dir}/none.png", "does not exist"),
                       (f"file://{media_dir}/sub", "not a regular file"),
                       (f"file://otherhost{media_dir}/sub/cat.png", "names host")]:
        with pytest.raises(MediaError, match=match):
            asyncio.run(f.fetch(url))


def test_file_urls_are_refused_without_an_allowed_path(media_dir):
    with pytest.raises(MediaError, match="start the gateway with --allowed-local-media-path"):
        asyncio.run(MediaFetcher(FetchConfig()).fetch(f"file://{media_dir}/sub/cat.png"))
    with pytest.raises(MediaError, match="at most 10 are read"):
        asyncio.run(MediaFetcher(FetchConfig(allowed_local_path=str(media_dir), max_bytes=10)).fetch(
            f"file://{media_dir}/sub/cat.png"))


@pytest.mark.parametrize("kwargs, match", [({"max_bytes": 0}, "--media-max-mb"), ({"timeout_s": 0}, "--media-timeout-s"),
                                           ({"allowed_local_path": "/no/such/dir"}, "is not a directory")])
def test_bad_fetch_config_says_which_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FetchConfig(**kwargs)


def test_resolver_fetches_urls_then_decodes():
    async def main():
        async with Server() as srv:
            url = srv.base + "/img.png"
            parts = [MediaPart("image", MediaRef("image", url)), MediaPart("video", MediaRef("video", [url, url]))]
            resolver = MediaResolver(MediaConfig(), MediaFetcher(FetchConfig(allowed_domains=LOCAL)))
            return url, parts, await resolver.fetch(parts), await resolver.resolve(parts)
    url, parts, fetched, (image, video) = asyncio.run(main())
    assert image.value.size == (20, 10) and [f.size for f in video.value] == [(20, 10)] * 2
    assert [p.ref.source for p in parts] == [url, [url, url]]  # new parts; the given ones are left as they were
    assert isinstance(fetched[0].ref.source, bytes) and not fetched[0].decoded
    assert all(isinstance(f, bytes) for f in fetched[1].ref.source)


def test_decoding_runs_in_a_worker_thread_not_on_the_event_loop():
    import threading

    seen = []

    class Watched(MediaResolver):
        def decode_all(self, refs):
            seen.append(threading.get_ident())
            return super().decode_all(refs)

    async def main():
        (part,) = await Watched(MediaConfig()).resolve([MediaPart("image", MediaRef("image", png()))])
        return threading.get_ident(), part.value
    loop_thread, image = asyncio.run(main())
    assert image.size == (20, 10) and seen and seen[0] != loop_thread


def test_audio_url_part_is_fetched_and_resampled():
    """OpenAI `audio_url` (vLLM's name) -> MediaRef -> fetched FLAC -> mono float32 at the model's rate."""
    import numpy as np

    from easerve.stages.gateway import openai_api as oa
    from tests.models.media_clips import tone

    async def main():
        async with Server() as srv:
            part = oa.convert_part({"type": "audio_url", "audio_url": {"url": srv.base + "/tone.flac"}}, ("audio",))
            resolver = MediaResolver(MediaConfig(audio_rate=16000), MediaFetcher(FetchConfig(allowed_domains=LOCAL)))
            (decoded,) = await resolver.resolve([part])
            return decoded
    part = asyncio.run(main())
    want = tone(0.5, 44100).mean(1)  # 16-bit in the file
    assert part.kind == "audio" and part.value.shape == (8000,)
    got_energy, want_energy = float(np.mean(part.value ** 2)), float(np.mean(want ** 2))
    assert abs(got_energy - want_energy) < 0.01 * want_energy


def test_fetch_turns_inline_payloads_into_bytes_once_in_a_worker_thread():
    """A data: URI (and a frame list of base64 strings) becomes its bytes in fetch(), in a thread,
    with the CPU time reported; the bytes are what the decode and the encoder cache use after."""
    import base64
    import threading

    from easerve.media import common

    raw = png()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    threads, cpu = [], []
    real = common.to_bytes

    def counted(data, what):
        threads.append(threading.get_ident())
        return real(data, what)

    async def main():
        parts = [MediaPart("image", MediaRef("image", uri)),
                 MediaPart("video", MediaRef("video", [base64.b64encode(raw).decode(), raw]))]
        fetched = await MediaResolver(MediaConfig()).fetch(parts, cpu.append)
        return threading.get_ident(), fetched
    import easerve.media.resolve as resolve_mod
    saved = resolve_mod.to_bytes
    resolve_mod.to_bytes = counted
    try:
        loop_thread, (image, video) = asyncio.run(main())
    finally:
        resolve_mod.to_bytes = saved
    assert image.ref.source == raw and video.ref.source == [raw, raw]
    assert len(threads) == 2 and loop_thread not in threads  # two strings, each decoded once, off the loop
    assert len(cpu) == 1 and cpu[0] >= 0


def test_fetch_refuses_bad_base64_naming_the_item():
    async def main():
        await MediaResolver(MediaConfig()).fetch([MediaPart("image", MediaRef("image", "data:image/png;base64,@@@"))])
    with pytest.raises(MediaError, match="image is not valid base64"):
        asyncio.run(main())


def test_is_url_reads_only_the_scheme():
    from easerve.media.common import is_url
    assert is_url("  HTTPS://x/y.png") and is_url("file:///a.png") and not is_url("data:image/png;base64,aHR0cDov")
    assert not is_url("aHR0cHM6Ly9" * 100_000) and not is_url(b"http://x")
