"""`make_tiny`: random-weight checkpoints of each supported family in the layout transformers 5
saves, built from the transformers config classes (no hub needed), and the marker every tiny
checkpoint carries (`is_tiny`). Same family + seed + scale -> same bytes."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from easerve.models.tiny.common import scale as _scale, seed_everything

BUILDERS = {
    "llava-next": "easerve.models.tiny.llava_next",
    "qwen2.5-vl": "easerve.models.tiny.qwen2_5_vl",
    "qwen2-audio": "easerve.models.tiny.qwen2_audio",
    "ultravox": "easerve.models.tiny.ultravox",
}
MARKER = "easerve-tiny.json"  # written into every tiny checkpoint: {"family", "seed", "scale"}


def make_tiny(family: str, out: str | Path, seed: int = 0, scale: str = "tiny") -> Path:
    """Write a complete checkpoint folder for `family` to `out` and return it.

    Each family module exposes `build(out: Path, seed: int, scale: Scale) -> None`.
    """
    if family not in BUILDERS:
        raise ValueError(f"unknown --family {family!r}; choose one of {sorted(BUILDERS)}")
    sc = _scale(scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    importlib.import_module(BUILDERS[family]).build(out, seed, sc)
    (out / MARKER).write_text(json.dumps({"family": family, "seed": seed, "scale": scale}) + "\n")
    return out


def is_tiny(path: str | Path) -> bool:
    """Whether `path` is a checkpoint written by `make_tiny` (random weights)."""
    return (Path(path) / MARKER).is_file()


def tiny_notice(path: str | Path) -> str:
    """What to tell a user who is about to serve a tiny random-weight checkpoint."""
    return (f"NOTE: {path} is a tiny EAServe test checkpoint with RANDOM weights: it serves every API, "
            "but its text is noise. To serve a real model, point --model at a local checkpoint folder of a "
            f"supported family ({', '.join(sorted(BUILDERS))}), e.g. "
            "hasctl up --model /models/Qwen2.5-VL-7B-Instruct --device cuda:0")
