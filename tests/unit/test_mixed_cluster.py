"""bench/mixed_cluster.py: nodes per model for a mixed workload. Each model's share of the mixed
rate R must fit the nodes it gets (n * one node's goodput >= share * R); the split maximizes R."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mixed_cluster", ROOT / "bench" / "mixed_cluster.py")
mc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mc)


def test_the_split_maximizes_the_mixed_rate_by_hand():
    """8 nodes; image 8 req/s a node, video 8, audio 15.45; mix 0.3 / 0.2 / 0.5. Image 3 nodes
    carry 24 = 0.3 R -> R 80; video 2 -> 16 = 0.2 R -> 80; audio 3 -> 46.35 = 0.5 R -> 92.7: R = 80.
    Every other split is lower (e.g. 3/3/2: audio 30.9 / 0.5 = 61.8)."""
    g = {"image": 8.0, "video": 8.0, "audio": 15.45}
    mix = {"image": 0.3, "video": 0.2, "audio": 0.5}
    split, r = mc.best_split(8, g, mix)
    assert split == {"image": 3, "video": 2, "audio": 3} and r == pytest.approx(80.0)
    assert mc.mixed_rate({"image": 3, "video": 3, "audio": 2}, g, mix) == pytest.approx(61.8)
    for a in range(1, 7):
        for b in range(1, 8 - a):
            assert mc.mixed_rate({"image": a, "video": b, "audio": 8 - a - b}, g, mix) <= r + 1e-9
    assert mc.even_split(8, list(mix)) == {"image": 3, "video": 3, "audio": 2}


def test_bad_mixes_are_refused_with_what_to_change(capsys):
    for argv, msg in ((["--mix", "image=0.5,speech=0.5"], "modalities from"),
                      (["--mix", "image"], "modality=share pairs"),
                      (["--nodes", "2"], "at least one per modality")):
        with pytest.raises(SystemExit):
            mc.args_of(argv)
        assert msg in capsys.readouterr().err
    assert mc.args_of(["--mix", "image=3,audio=1"]).mix == {"image": 0.75, "audio": 0.25}
