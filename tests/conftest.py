"""Fixtures every test directory shares."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Folder the tiny random-weight checkpoints are built in, once per session
    (`EASERVE_TINY_CACHE` reuses one across sessions)."""
    root = os.environ.get("EASERVE_TINY_CACHE")
    return root or str(tmp_path_factory.mktemp("tiny"))
