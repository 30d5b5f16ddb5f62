"""Family registry: which adapter class serves which checkpoint folder (loading one:
`easerve.models.loader.load_adapter`)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

# family -> (module, adapter class): imported only when that family is loaded
FAMILIES: dict[str, tuple[str, str]] = {
    "llava-next": ("easerve.models.llava_next", "LlavaNextAdapter"),
    "qwen2.5-vl": ("easerve.models.qwen2_5_vl", "Qwen25VLAdapter"),
    "qwen2-audio": ("easerve.models.qwen2_audio", "Qwen2AudioAdapter"),
    "ultravox": ("easerve.models.ultravox", "UltravoxAdapter"),
}
# any of config.architectures -> family (the one place a family's architecture names live)
ARCHITECTURES: dict[str, str] = {
    "LlavaNextForConditionalGeneration": "llava-next",
    "Qwen2_5_VLForConditionalGeneration": "qwen2.5-vl",
    "Qwen2AudioForConditionalGeneration": "qwen2-audio",
    "UltravoxModel": "ultravox",
}
# config.model_type -> family (when no architecture name matched)
MODEL_TYPES: dict[str, str] = {
    "llava_next": "llava-next",
    "qwen2_5_vl": "qwen2.5-vl",
    "qwen2_audio": "qwen2-audio",
    "ultravox": "ultravox",
}


class UnsupportedModelError(ValueError):
    """The folder holds a model family EAServe has no adapter for."""


def _supported_text() -> str:
    return ", ".join(f"{a} ({f})" for a, f in ARCHITECTURES.items())


def detect_family(path: str | Path) -> str:
    """Read config.json and name the family, or raise UnsupportedModelError."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(
            f"{path} has no config.json; point --model at a checkpoint folder of one of: {_supported_text()}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{cfg_path} is not valid JSON: {e}") from None
    for arch in cfg.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    mt = cfg.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    found = cfg.get("architectures") or mt
    raise UnsupportedModelError(
        f"unsupported architecture {found!r} in {path}; EAServe supports: {_supported_text()}")


def adapter_class(family: str):
    if family not in FAMILIES:
        raise UnsupportedModelError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    mod, cls = FAMILIES[family]
    return getattr(importlib.import_module(mod), cls)


DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(dtype):
    """None / "auto" (the device's default: float32 on CPU, bfloat16 on GPU), a name in DTYPES or a
    torch.dtype -> torch.dtype or None."""
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return None if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose auto or one of {DTYPES}")
    return getattr(torch, dtype)
