"""`--model ORG/NAME[@REVISION]` through easerve.models.hub, against a pre-populated hub cache
(tests/support/hub_cache.py) with huggingface_hub offline: no network anywhere."""
from __future__ import annotations

import os

import pytest

from easerve.models.hub import HubModelError, parse_hub_id, resolve_model, served_name, weight_files
from easerve.models.loader import load_adapter
from easerve.models.tiny import cached_tiny
from tests.support.hub_cache import ENCODER_SHARD, LM_SHARD, SHA, populate_hub

OLD_SHA = "f" * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return cached_tiny("qwen2.5-vl", os.environ.get("EASERVE_TINY_CACHE") or tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty HF_HOME, huggingface_hub offline (its constants are read once, at its import)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_parse_hub_id_and_local_paths(tiny, tmp_path, monkeypatch):
    ref = parse_hub_id("Qwen/Qwen2.5-VL-7B-Instruct@v1.0")
    assert (ref.repo_id, ref.revision) == ("Qwen/Qwen2.5-VL-7B-Instruct", "v1.0")
    assert parse_hub_id("Org/Name").revision is None
    for local in (str(tiny), "./Org/Name", "/models/x", "~/x/y", "a/b/c", "name-only"):
        assert parse_hub_id(local) is None, local
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # an existing relative folder wins over the hub id of the same spelling
    assert parse_hub_id("Org/Name") is None
    assert served_name("Org/Name@abc") == "Org/Name"


def test_hub_id_resolves_to_the_cached_snapshot_offline(tiny, hf_home):
    snap = populate_hub(hf_home, tiny)
    assert resolve_model("Org/Name") == snap
    assert snap.name == SHA and (snap / "config.json").is_file()


def test_revision_names_a_snapshot(tiny, hf_home):
    main = populate_hub(hf_home, tiny)
    old = populate_hub(hf_home, tiny, sha=OLD_SHA, ref="v1")
    assert resolve_model(f"Org/Name@{OLD_SHA}") == old
    assert resolve_model("Org/Name@v1") == old
    assert resolve_model("Org/Name@main") == main


def test_missing_snapshot_offline_names_the_command(hf_home):
    with pytest.raises(HubModelError) as e:
        resolve_model("Org/Missing@v2", ("encode",))
    assert "hf download Org/Missing --revision v2" in str(e.value)
    assert "HF_HUB_OFFLINE" in str(e.value)


def test_a_local_folder_passes_through(tiny, hf_home):
    assert resolve_model(str(tiny), ("encode",)) == tiny


def test_encode_files_exclude_the_lm_shards(tiny, hf_home):
    snap = populate_hub(hf_home, tiny)
    assert weight_files(snap, ("encode",)) == [ENCODER_SHARD]
    assert weight_files(snap, ("prefill",)) == weight_files(snap, ("decode",)) == [LM_SHARD]
    assert weight_files(snap, ("processor",)) == []
    assert weight_files(snap, ("full",)) == [ENCODER_SHARD, LM_SHARD]


def test_an_encode_only_snapshot_serves_encode_and_not_decode(tiny, hf_home):
    """What an encode-only instance fetched is enough for it; a decode on the same cache says
    which file to fetch."""
    snap = populate_hub(hf_home, tiny, skip=(LM_SHARD,))
    adapter = load_adapter("Org/Name", role="encode")
    assert adapter.path == str(snap) and adapter.model.model.visual is not None
    with pytest.raises(HubModelError) as e:
        resolve_model("Org/Name", ("decode",))
    assert f"hf download Org/Name --include '{LM_SHARD}'" in str(e.value)
