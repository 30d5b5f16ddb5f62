"""Loading a model: `--model` (a folder or a hub id) to a ready adapter of its family."""
from __future__ import annotations

from pathlib import Path

from easerve.models.hub import resolve_model
from easerve.models.registry import adapter_class, detect_family, torch_dtype


def load_adapter(model: str | Path, role: str = "full", device: str = "cpu", dtype=None):
    """Build the adapter for `model` (a checkpoint folder or a hub id, fetched with only the files
    `role` uses: easerve.models.hub), loading only the weights `role` uses, in `dtype`
    (see `torch_dtype`; None = float32 on CPU, bfloat16 on GPU). `adapter.path` is the folder."""
    path = resolve_model(str(model), (role,))
    family = detect_family(path)
    return adapter_class(family)(str(path), role=role, device=device, dtype=torch_dtype(dtype))
