"""`hasctl demo`: the main job on a fresh machine.

Default: launch the full stack (gateway, encode, prefill, decode as separate processes)
on the default tiny checkpoint, send an image request through the gRPC SDK and a
streaming video request through the OpenAI-compatible HTTP API, print the answers and
stop. `--in-process` runs image, video and audio prompts through E -> P -> D in one
process instead (no sockets)."""
from __future__ import annotations

import base64
import io
import json
import os
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from easerve.types import SamplingParams

CACHE = Path(os.path.expanduser("~/.cache/easerve/tiny"))


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="start the stack on the tiny model and answer real requests")
    p.add_argument("--cache", default=str(CACHE), help="where the tiny checkpoints are built")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--preset", default="colocated", help="deployment preset of the stack")
    p.add_argument("--in-process", action="store_true", help="no services: E -> P -> D in this process")
    p.set_defaults(func=run)


def _png(seed: int, h: int, w: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def run(args) -> int:
    return run_in_process(args) if args.in_process else run_stack(args)


def run_stack(args) -> int:
    from easerve import Client
    from easerve.models.tiny import DEFAULT_FAMILY, cached_tiny
    from easerve.models.tiny.build import tiny_notice
    from hasctl.deployment import preset
    from hasctl.launch import Stack

    model = str(cached_tiny(DEFAULT_FAMILY, args.cache))
    print(tiny_notice(model), flush=True)
    with Stack(preset(args.preset).with_model(model).with_gateway_ports(0, 0)) as stack:
        ep = stack.endpoints
        print(f"stack up: gRPC {ep.grpc}, HTTP {ep.http} (logs in {stack.run_dir})", flush=True)
        out = Client(ep.grpc, timeout=120).generate("Describe the image.", images=[_png(0, 48, 64)],
                                                    max_tokens=args.max_tokens)
        print(f"[SDK image] {len(out.token_ids)} tokens ({out.finish_reason}): {out.text!r}")
        print(f"[HTTP video, streamed] {_stream_video(ep.http, args.max_tokens)!r}")
    print("(random weights: the answers above are noise; hasctl up --model DIR serves a real checkpoint)")
    return 0


def _stream_video(http: str, max_tokens: int) -> str:
    served = json.loads(urllib.request.urlopen(http + "/v1/models", timeout=30).read())["data"][0]["id"]
    body = {"model": served, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"frames": [_uri(_png(i, 56, 56)) for i in range(4)]}},
        {"type": "text", "text": "What happens in the video?"}]}]}
    req = urllib.request.Request(http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text.append(choices[0].get("delta", {}).get("content") or "")
    return "".join(text)


def demo_requests() -> list[tuple[str, str, dict]]:
    """(family, label, media part) for one prompt per modality."""
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)) for _ in range(4)]
    audio = (0.1 * np.sin(np.linspace(0, 400 * np.pi, 16000))).astype(np.float32)
    return [
        ("qwen2.5-vl", "image", {"type": "image", "image": img}),
        ("qwen2.5-vl", "video", {"type": "video", "video": frames}),
        ("qwen2-audio", "audio", {"type": "audio", "audio": audio}),
    ]


def run_in_process(args) -> int:
    from easerve.models.tiny import cached_tiny
    from easerve.models.tiny.build import tiny_notice
    from easerve.pipeline import InProcessPipeline

    pipes: dict[str, InProcessPipeline] = {}
    for family, label, part in demo_requests():
        if family not in pipes:
            path = cached_tiny(family, args.cache)
            print(tiny_notice(path), flush=True)
            pipes[family] = InProcessPipeline(str(path))
        msgs = [{"role": "user", "content": [part, {"type": "text", "text": f"Describe the {label}."}]}]
        out = pipes[family].run([(msgs, SamplingParams(max_tokens=args.max_tokens))])[0]
        print(f"[{family} {label}] {len(out.token_ids)} tokens ({out.finish_reason}): {out.text!r}")
    return 0
