"""Real media through a real gateway process: an MP4 file, images by http:// and file:// URL,
and refused URLs (400 / INVALID_ARGUMENT), over HTTP and gRPC.

A second gateway is started on the session's Qwen2.5-VL stack's encode and prefill workers
with the media flags (--allowed-media-domains 127.0.0.1, --allowed-local-media-path); the
stack's own gateway answers the same content given as decoded frames / an inline image, and
the two must agree token for token."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from easerve import Client
from easerve.errors import InvalidRequest
from easerve.wire.v1 import gateway_pb2 as gpb
from tests.support.media import data_uri, png_bytes
from tests.models.media_clips import decode_all_frames, encode_video, smooth_frames

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMPT = "What is this?"
N = 8


class _Files(SimpleHTTPRequestHandler):
    """Serves the media folder; /slow answers after 30 s (the gateway gives up after 3)."""

    def do_GET(self):
        if self.path == "/slow":
            time.sleep(30)
        return super().do_GET()

    def log_message(self, *args):
        pass


def _wait_port(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if path.exists():
            return int(path.read_text())
        time.sleep(0.2)
    raise TimeoutError(f"gateway did not bind in {timeout} s:\n{log.read_text()[-3000:]}")


def _wait_healthy(url: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health never answered 200")


@pytest.fixture(scope="module")
def media_gw(vl_stack, tmp_path_factory):
    """A gateway with the media flags, plus a plain HTTP file server on 127.0.0.1."""
    root, run = tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("gw")
    files = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=str(root)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    stages = vl_stack.endpoints.stages
    log = run / "gateway.log"
    cmd = [sys.executable, "-m", "services.gateway", "--model", vl_stack.deployment.model,
           "--encode", stages["encode-0"], "--prefill", stages["prefill-0"], "--decode", stages["decode-0"],
           "--threads", "1",
           "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
           "--port-file", str(run / "grpc.port"), "--http-port-file", str(run / "http.port"),
           "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(root),
           "--media-timeout-s", "3", "--media-max-mb", "1", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        grpc_port = _wait_port(run / "grpc.port", proc, log)
        http_port = _wait_port(run / "http.port", proc, log)
        http = f"http://127.0.0.1:{http_port}"
        _wait_healthy(http)
        yield SimpleNamespace(http=http, grpc=f"127.0.0.1:{grpc_port}", root=root,
                              files=f"http://127.0.0.1:{files.server_address[1]}")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        files.shutdown()


def _openai(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(base: str, media_part: dict):
    client = _openai(base)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, max_tokens=N, temperature=0, messages=[
        {"role": "user", "content": [media_part, {"type": "text", "text": PROMPT}]}])


def test_mp4_file_and_url_images_get_200_and_the_same_tokens(vl_stack, media_gw):
    clip = encode_video(smooth_frames(16, 56, 56), "mp4-h264", fps=8)  # 2 s: 4 frames at 2 fps
    r = _chat(media_gw.http, {"type": "video_url", "video_url": {"url": data_uri(clip, "video/mp4")}})
    frames = [data_uri(_png(f)) for f in decode_all_frames(clip)[[0, 4, 8, 12]]]
    want = _chat(vl_stack.endpoints.http, {"type": "video_url", "video_url": {"frames": frames, "fps": 2}})
    assert r.usage.completion_tokens > 0
    assert r.choices[0].message.content == want.choices[0].message.content
    assert r.usage.prompt_tokens == want.usage.prompt_tokens

    img = png_bytes(48, 80, seed=5)
    (media_gw.root / "cat.png").write_bytes(img)
    inline = _chat(vl_stack.endpoints.http, {"type": "image_url", "image_url": {"url": data_uri(img)}})
    for url in (f"{media_gw.files}/cat.png", f"file://{media_gw.root}/cat.png"):
        got = _chat(media_gw.http, {"type": "image_url", "image_url": {"url": url}})
        assert got.choices[0].message.content == inline.choices[0].message.content, url


def test_grpc_takes_a_video_file_and_an_image_url(vl_stack, media_gw):
    clip = encode_video(smooth_frames(16, 56, 56, seed=3), "webm-vp9", fps=8)
    got = Client(media_gw.grpc, timeout=120).generate(PROMPT, video=clip, max_tokens=N)
    frames = [_png(f) for f in decode_all_frames(clip)[[0, 4, 8, 12]]]
    want = Client(vl_stack.endpoints.grpc, timeout=120).generate(PROMPT, video=frames, video_fps=2.0, max_tokens=N)
    assert list(got.token_ids) == list(want.token_ids) and len(got.token_ids) > 0

    img = png_bytes(40, 40, seed=9)
    (media_gw.root / "dog.png").write_bytes(img)
    part = gpb.ContentPart(image=gpb.ImageInput(url=f"{media_gw.files}/dog.png"))
    by_url = Client(media_gw.grpc, timeout=120).generate(messages=[{"role": "user", "content": [part, PROMPT]}],
                                                          max_tokens=N)
    inline = Client(vl_stack.endpoints.grpc, timeout=120).generate(PROMPT, images=[img], max_tokens=N)
    assert list(by_url.token_ids) == list(inline.token_ids)


@pytest.mark.parametrize("url, needle", [
    ("http://10.0.0.7/cat.png", "not in --allowed-media-domains"),
    ("http://localhost:{port}/cat.png", "'localhost' is not in --allowed-media-domains"),
    ("file://{repo}/pyproject.toml", "outside --allowed-local-media-path"),
    ("{files}/missing.png", "answered HTTP 404"),
    ("{files}/big.bin", "at most 1048576 are fetched"),
    ("{files}/slow", "took longer than 3 s"),
])
def test_refused_urls_get_400_and_the_gateway_keeps_serving(media_gw, url, needle):
    import openai

    (media_gw.root / "big.bin").write_bytes(b"x" * (2 << 20))
    url = url.format(port=media_gw.files.rsplit(":", 1)[1], files=media_gw.files, repo=REPO)
    with pytest.raises(openai.BadRequestError, match=needle):
        _chat(media_gw.http, {"type": "image_url", "image_url": {"url": url}})
    part = gpb.ContentPart(image=gpb.ImageInput(url=url))
    with pytest.raises(InvalidRequest, match=needle):  # INVALID_ARGUMENT
        Client(media_gw.grpc, timeout=60).generate(messages=[{"role": "user", "content": [part, PROMPT]}],
                                                   max_tokens=N)
    assert urllib.request.urlopen(media_gw.http + "/health", timeout=5).status == 200


def _png(arr) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def test_a_gateway_without_an_allow_list_refuses_private_addresses(vl_stack, media_gw):
    """The stack's own gateway has no --allowed-media-domains: public hosts only, so 127.0.0.1 is refused."""
    import openai

    (media_gw.root / "cat.png").write_bytes(png_bytes(32, 32, seed=1))
    with pytest.raises(openai.BadRequestError, match="resolves to the non-public address 127.0.0.1"):
        _chat(vl_stack.endpoints.http, {"type": "image_url", "image_url": {"url": f"{media_gw.files}/cat.png"}})
    with pytest.raises(openai.BadRequestError, match="--allowed-local-media-path"):
        _chat(vl_stack.endpoints.http, {"type": "image_url", "image_url": {"url": f"file://{media_gw.root}/cat.png"}})
