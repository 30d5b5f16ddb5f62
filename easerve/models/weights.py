"""Partial weight loading: read only the tensors a role uses.

An adapter builds the full HF class on the meta device (free), swaps in real
submodules for the parts its role needs (built by their own constructors, so
non-persistent buffers such as rotary tables are computed as usual), and fills
them from the checkpoint with `read_tensors`, which opens the safetensors files
lazily and reads only the keys it is asked for. Nothing else is materialised.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

KeyMap = Callable[[str], str | None]
log = logging.getLogger("easerve.models.weights")


def checkpoint_files(path: str | Path, key_map: KeyMap | None = None) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded); of a sharded one,
    with `key_map`, only the shards holding a tensor it keeps (the others need not be there:
    a hub snapshot of one role's files, easerve.models.hub)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({f for k, f in weight_map.items() if key_map is None or key_map(k) is not None})
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{root} has no model.safetensors(.index.json); save the checkpoint with safetensors")


def renamer(rules: Iterable[tuple[str, str]]) -> Callable[[str], str]:
    """Chain of regex renames (legacy hub layout -> transformers 5 layout)."""
    compiled = [(re.compile(p), r) for p, r in rules]

    def rename(key: str) -> str:
        for pat, rep in compiled:
            key = pat.sub(rep, key)
        return key

    return rename


def read_tensors(path: str | Path, key_map: KeyMap, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read only the tensors whose mapped name is not None; returns {mapped: tensor}."""
    out: dict[str, torch.Tensor] = {}
    total = 0
    for f in checkpoint_files(path, key_map):
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for key in sf.keys():
                total += 1
                target = key_map(key)
                if target is None:
                    continue
                t = sf.get_tensor(key)
                out[target] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    log.info("read %d of %d tensors (%d parameters) from %s: %s", len(out), total,
             sum(t.numel() for t in out.values()), path, ", ".join(module_prefixes(out)) or "-")
    return out


def module_prefixes(names: Iterable[str]) -> list[str]:
    """The top modules `names` lie under ('model.visual', 'lm_head', 'audio_tower', ...)."""
    def top(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "model" and len(parts) >= 2 else parts[0]
    return sorted({top(n) for n in names})


def under(prefixes: Iterable[str], rename: Callable[[str], str] = lambda k: k) -> KeyMap:
    """Key map keeping keys that (after `rename`) are or start with one of `prefixes`
    (module paths, matched at a '.' boundary); kept keys are returned renamed, in full."""
    prefs = tuple(prefixes)

    def key_map(key: str) -> str | None:
        k = rename(key)
        for p in prefs:
            if k == p or k.startswith(p + "."):
                return k
        return None

    return key_map


@contextmanager
def fast_init():
    """Skip random weight init while building modules whose weights we load anyway."""
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def get_submodule(root: torch.nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_submodule(root: torch.nn.Module, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    owner = get_submodule(root, parent) if parent else root
    setattr(owner, name, value)


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str,
              allow_missing: Iterable[str] = ()) -> None:
    """Load `prefix.*` entries of `tensors` into `module`; every parameter must be found."""
    sub = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    missing, unexpected = module.load_state_dict(sub, strict=False)
    missing = [m for m in missing if not any(m.startswith(a) for a in allow_missing)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {prefix}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def meta_skeleton(model_cls, config):
    """The full model on the meta device: structure and methods, no memory."""
    with torch.device("meta"):
        return model_cls(config)


def held_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that hold real memory (meta placeholders excluded)."""
    seen, out = set(), []
    for p in module.parameters():
        if p.device.type != "meta" and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
