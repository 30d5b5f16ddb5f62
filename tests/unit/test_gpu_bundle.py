"""The GPU bundle's size check: under 40 MiB passes, over it fails naming the largest wheels."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_gpu_bundle", ROOT / "scripts" / "build_gpu_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_size_check(tmp_path) -> None:
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    assert bundle.check_size(tmp_path, limit=2000) == 1000
    (tmp_path / "av-19.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x" * 5000)
    with pytest.raises(ValueError, match=r"over 0 MiB; largest: av-19.0-cp312"):
        bundle.check_size(tmp_path, limit=2000)
    assert bundle.LIMIT_BYTES == 40 << 20 and "av" not in bundle.PACKAGES
