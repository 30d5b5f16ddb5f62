"""The tiny checkpoint builder is deterministic: the same family and seed give the same bytes in
every file; another seed gives other weights."""
from __future__ import annotations

import pytest

from easerve.models.tiny.build import make_tiny


@pytest.mark.parametrize("family", ["llava-next", "qwen2.5-vl", "qwen2-audio", "ultravox"])
def test_same_seed_same_bytes(tmp_path, family):
    a, b, c = (make_tiny(family, tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
