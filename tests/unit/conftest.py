"""Fixtures the unit tests share: an event loop per module and the tiny Qwen2.5-VL processor
adapter (built once under EASERVE_TINY_CACHE, or a temporary folder)."""
from __future__ import annotations

import asyncio
import os

import pytest


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from easerve.models.loader import load_adapter
    from easerve.models.tiny import cached_tiny

    root = os.environ.get("EASERVE_TINY_CACHE") or tmp_path_factory.mktemp("tiny")
    return load_adapter(cached_tiny("qwen2.5-vl", root), role="processor")
