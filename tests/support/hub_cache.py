"""A pre-populated Hugging Face hub cache (no network): a checkpoint folder laid out as
`HF_HOME/hub/models--ORG--NAME/{refs/<ref>, snapshots/<sha>/...}`, which huggingface_hub reads
offline, its weights split into an encoder shard and an LM shard with a safetensors index."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

ENCODER_SHARD, LM_SHARD = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
SHA = "0" * 39 + "1"


def populate_hub(hf_home: Path, checkpoint: Path, repo_id: str = "Org/Name", sha: str = SHA,
                 encoder_prefix: str = "visual.", ref: str = "main", skip: tuple[str, ...] = ()) -> Path:
    """Write `checkpoint` (one model.safetensors) as snapshot `sha` of `repo_id`, `ref` pointing at
    it: tensors under `encoder_prefix` in ENCODER_SHARD, the rest in LM_SHARD (files named in
    `skip` left out, as an encode-only download leaves them). Returns the snapshot folder."""
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    for f in Path(checkpoint).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy(f, snap / f.name)
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    shards = {ENCODER_SHARD: {k: v for k, v in tensors.items() if k.startswith(encoder_prefix)},
              LM_SHARD: {k: v for k, v in tensors.items() if not k.startswith(encoder_prefix)}}
    assert all(shards.values()), "both shards must hold tensors"
    for name, part in shards.items():
        if name not in skip:
            save_file(part, str(snap / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(sha)
    return snap
