"""`hasctl demo`: the main job on a fresh machine, in-process: build the default
tiny checkpoints, run an image, a video and an audio prompt through
encode -> prefill -> decode, and print what each generated."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from easerve.types import SamplingParams

CACHE = Path(os.path.expanduser("~/.cache/easerve/tiny"))


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run image, video and audio prompts through E -> P -> D in-process")
    p.add_argument("--cache", default=str(CACHE), help="where the tiny checkpoints are built")
    p.add_argument("--max-tokens", type=int, default=12)
    p.set_defaults(func=run)


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


def run(args) -> int:
    from easerve.models.tiny import cached_tiny
    from easerve.pipeline import InProcessPipeline

    pipes: dict[str, InProcessPipeline] = {}
    for family, label, part in demo_requests():
        if family not in pipes:
            pipes[family] = InProcessPipeline(str(cached_tiny(family, args.cache)))
        msgs = [{"role": "user", "content": [part, {"type": "text", "text": f"Describe the {label}."}]}]
        out = pipes[family].run([(msgs, SamplingParams(max_tokens=args.max_tokens))])[0]
        print(f"[{family} {label}] {len(out.token_ids)} tokens ({out.finish_reason}): {out.text!r}")
    return 0
