"""Tiny random-weight checkpoints of each supported family, in either layout (`make_layout`),
cached on disk (`cached_tiny`): the default one transformers 5 saves (easerve.models.tiny.build)
or the published hub layout of the same weights (easerve.models.tiny.published)."""
from __future__ import annotations

from pathlib import Path

from easerve.models.tiny.build import make_tiny
from easerve.models.tiny.published import make_published

DEFAULT_FAMILY = "qwen2.5-vl"
LAYOUTS = ("default", "published")


def make_layout(family: str, out: str | Path, seed: int = 0, scale: str = "tiny", layout: str = "default") -> Path:
    """make_tiny (`default`: what transformers 5 saves) or the published hub layout of the same weights
    (`published`: see `easerve.models.tiny.published`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown --layout {layout!r}; choose one of {LAYOUTS}")
    if layout == "published":
        return make_published(family, out, seed=seed, scale=scale)
    return make_tiny(family, out, seed=seed, scale=scale)


def cached_tiny(family: str, root: str | Path, seed: int = 0, scale: str = "tiny", layout: str = "default") -> Path:
    """make_layout into root/<family>-<scale>-s<seed>[-<layout>], reusing a complete earlier build."""
    out = Path(root) / (f"{family}-{scale}-s{seed}" + ("" if layout == "default" else f"-{layout}"))
    marker = out / ".complete"
    if not marker.exists():
        make_layout(family, out, seed=seed, scale=scale, layout=layout)
        marker.write_text("ok\n")
    return out
