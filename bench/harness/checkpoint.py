"""The checkpoint a bench serves: the folder given with --model, else a tiny random-weight build
of the family (easerve.models.tiny), made once under the cache folder and reused."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "runs" / "tiny"


def checkpoint(model: str | None = None, cache_dir: str | Path | None = None, family: str = "qwen2.5-vl",
               scale: str = "bench") -> str:
    """`model` when given; else the tiny `family` checkpoint at `scale` ("tiny" or "bench"),
    built into cache_dir (default runs/tiny) the first time."""
    if model:
        return model
    from easerve.models.tiny import cached_tiny
    return str(cached_tiny(family, cache_dir or CACHE, seed=0, scale=scale))


def served_name(model: str) -> str:
    """The model id the gateway serves a checkpoint folder under (its folder name)."""
    return Path(model).resolve().name
