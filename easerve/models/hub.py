"""`--model` as a local checkpoint folder or a hub id `ORG/NAME[@REVISION]`: the one place a
model name becomes a folder (`resolve_model`, called by `easerve.models.loader.load_adapter`
and by `hasctl` before it launches anything).

A hub id is fetched through `huggingface_hub.snapshot_download`, so its cache, `HF_HOME` /
`HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE` and its download progress bar all apply. Only the
files the asked roles use are fetched: the config, tokenizer, processor and chat template files
always (`META_PATTERNS`), and of the weights the safetensors files that hold a tensor of the
roles' parts (read from `model.safetensors.index.json`; the adapter's `weight_filter` says which
tensors a role reads). An encode-only instance therefore never fetches the LM shards. A folder
that exists locally is used as it is (a local path wins over a hub id of the same spelling).
Offline (or `local_files_only`) without the files cached, `HubModelError` names the command
that downloads them.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from easerve.models.registry import UnsupportedModelError, adapter_class, detect_family

META_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")  # config, tokenizer, processor, template
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


class HubModelError(ValueError):
    """A hub id that cannot be served: not cached while offline, unknown, gated, or incomplete."""


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None  # None: the default branch (main)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def download_command(self, patterns: Iterable[str] = ()) -> str:
        """The `hf` command that puts this snapshot (or only `patterns` of it) in the cache."""
        rev = f" --revision {self.revision}" if self.revision else ""
        include = "".join(f" --include '{p}'" for p in patterns)
        return f"hf download {self.repo_id}{rev}{include}"


def parse_hub_id(model: str) -> HubId | None:
    """The hub id `model` names, or None when it is a local path (an existing one, or one that
    starts with '/', '.' or '~', or has more than one '/')."""
    if not model or model.startswith(("/", ".", "~")) or Path(model).exists():
        return None
    m = _HUB_ID.match(model)
    return HubId(m.group("repo"), m.group("rev")) if m else None


def canonical(model: str) -> str:
    """`model` as a deployment keeps it: a hub id as given (each process resolves it), a local
    path made absolute (processes may run elsewhere than the caller's folder)."""
    return model if parse_hub_id(model) else str(Path(model).expanduser().resolve())


def served_name(model: str) -> str:
    """The model id clients send by default: a hub id's ORG/NAME (as vLLM serves it), else the
    folder's name."""
    ref = parse_hub_id(model)
    return ref.repo_id if ref else Path(model).resolve().name


def weight_files(folder: str | Path, roles: Iterable[str]) -> list[str]:
    """The safetensors files (relative names) that hold a tensor the `roles` read: from the index
    when the checkpoint is sharded, else the single file; none for 'processor' alone. A family
    EAServe has no adapter for (e.g. a text model an Ultravox config names) needs every shard."""
    roles = tuple(r for r in roles if r != "processor")
    if not roles:
        return []
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        return [SINGLE]
    weight_map: dict[str, str] = json.loads((folder / INDEX).read_text())["weight_map"]
    wanted = _tensor_filter(folder, roles)
    return sorted({f for key, f in weight_map.items() if wanted(key)})


def _tensor_filter(folder: Path, roles: tuple[str, ...]):
    try:
        cls = adapter_class(detect_family(folder))
    except UnsupportedModelError:
        return lambda key: True
    filters = [cls.weight_filter(r) for r in roles]
    return lambda key: any(f(key) is not None for f in filters)


def resolve_model(model: str, roles: Iterable[str] = ("full",)) -> Path:
    """The checkpoint folder `model` names, with the files `roles` use present. A local path is
    returned as given; a hub id is fetched into huggingface_hub's cache ($HF_HUB_CACHE, else
    $HF_HOME/hub) unless it is there already, and its snapshot folder returned (with
    HF_HUB_OFFLINE set, from the cache only)."""
    ref = parse_hub_id(model)
    if ref is None:
        return Path(model)
    roles = tuple(roles)
    folder = _download(ref, META_PATTERNS)
    files = weight_files(folder, roles)
    if files:
        folder = _download(ref, (*META_PATTERNS, *files))
    missing = [f for f in ("config.json", *files) if not (folder / f).is_file()]
    if missing:
        raise HubModelError(
            f"{ref}: the cached snapshot {folder} lacks {', '.join(missing)} (needed by {', '.join(roles)}) and "
            f"the hub cannot be reached or is not to be (HF_HUB_OFFLINE); fetch them first: "
            f"{ref.download_command(files)}")
    return folder


def _download(ref: HubId, patterns: tuple[str, ...]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=list(patterns)))
    except GatedRepoError:
        raise HubModelError(f"{ref} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                            "(or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise HubModelError(f"{ref}: no revision {ref.revision!r} on the hub; name a branch, tag or "
                            "commit of that repository") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"{ref.repo_id} is not a hub repository (nor a local folder); check the name, or "
                            "set HF_TOKEN for a private one") from None
    except LocalEntryNotFoundError as e:
        raise HubModelError(
            f"{ref} is not in the hub cache and cannot be downloaded now ({_why(e)}); download it first with "
            f"`{ref.download_command()}` (HF_HOME says where the cache is), then start again") from None


def _why(e: Exception) -> str:
    from huggingface_hub import constants
    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    return str(e).splitlines()[0][:200]
