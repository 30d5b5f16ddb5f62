"""`hasctl profile --quick` on a tiny checkpoint writes a profile that loads back and drives
`hasctl screen` and `hasctl bench --slo`."""
from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from easerve.models.tiny import cached_tiny
from hasctl.bench import slo_from_args
from hasctl.cli import main
from easerve.profile_format import TIERS, load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_profile_quick_writes_a_loadable_profile(tiny_root, tmp_path, capsys):
    model = cached_tiny("qwen2.5-vl", tiny_root)
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "hasctl.cli", "profile", "--model", str(model), "--quick",
                           "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile:" in proc.stderr and "100%" in proc.stderr  # the progress bar
    p = load(out)
    assert p.model.family == "qwen2.5-vl" and p.model.modalities == ("image", "video") and p.quick
    assert p.versions.torch and p.hardware.cores >= 1 and p.hardware.device.startswith("cpu:")
    enc = p.encode
    assert {pt.batch_size for pt in enc.grid} == {1, 2}
    if enc.backend == "none":  # one core: no split, and the file says so
        assert enc.shares == (1.0,) and "share 1.0 only" in enc.backend_note
    else:
        assert enc.backend == "cpu_affinity" and enc.shares == (0.5, 1.0)
    assert {(s.modality, s.media) for s in enc.by_size} == {("image", "56x56"), ("video", "2x56x56")}
    assert all(s.tokens_per_item >= 1 for s in enc.by_size)
    assert {(q.prompt_len, q.batch_size) for q in p.prefill} == {(16, 1), (16, 2), (48, 1), (48, 2)}
    assert [d.batch_size for d in p.decode] == [1, 4]
    assert [u.modality for u in p.unloaded] == ["image", "video", "text"]
    for t in p.tiers:
        for lim in t.limits:
            u = p.unloaded_for(lim.modality)
            assert lim.ttft_ms == pytest.approx(u.ttft_s * 1e3 * t.multiplier)
    assert [t.multiplier for t in p.tiers] == [2.0, 4.0, 8.0] and tuple(t.name for t in p.tiers) == TIERS

    assert main(["screen", "--profile", str(out), "--rate", "1", "--devices", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["kept"]) + len(res["removed"]) == 4  # E1-P1-D1 (+coloc), E1-P0-D2, E2-P0-D1 (+coloc)
    slo = slo_from_args(Namespace(slo="tight", profile=str(out), ttft_ms=None, tpot_ms=None))
    assert slo.tier == "tight" and slo.limits("video")[0] == pytest.approx(p.unloaded_for("video").ttft_s * 2e3)

    # revision 2: what the simulator reads besides the stage latencies, and hasctl simulate on it
    assert p.revision == 6 and p.transfer.kv_bytes_per_token > 0 and p.transfer.embed_bytes_per_token > 0
    stages = ("encode", "prefill", "decode")  # revision 4: each stage while one process of each kind shares the cores
    assert sorted((x.stage, x.by, x.busy) for x in p.sharing) == sorted((s, b, 1) for s in stages for b in stages)
    assert all(x.slowdown >= 1.0 and x.cores == p.hardware.cores for x in p.sharing)
    assert sorted(x.stage for x in p.shared_env) == sorted(stages)  # revision 6: alone there over alone here
    assert p.link("same_host").gb_per_s > 0 and p.link("other_host") is None
    assert {(g.modality, g.media) for g in p.gateway} == {("image", "56x56"), ("video", "2x56x56"), ("text", "")}
    assert {(x.stage, x.by) for x in p.interference} == {("encode", "prefill"), ("prefill", "encode")}
    sim_out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(out), "--preset", "default", "--rate", "2", "--requests", "20",
                 "--slo", "loose", "--image-size", "56x56", "--out", str(sim_out)]) == 0
    sim = json.loads(sim_out.read_text())
    assert sim["completed"] == 20 and sim["endpoint"] == "simulated" and sim["median_ttft_ms"] > 0


@pytest.mark.slow
def test_the_sharing_curve_is_measured_as_stages_that_share_cores_run(tiny_root, caplog):
    """The timed process and its neighbours run with SHARED_CORES_ENV (OpenMP threads that sleep
    at a barrier), the environment the launcher gives stages that share cores; this process's
    own thread pool, started without it, does not time the curve."""
    import logging

    from hasctl.deployment import SHARED_CORES_ENV
    from hasctl.profile_measure import Profiler
    from hasctl.profile_plan import QUICK
    from hasctl.profile_sharing import measure_sharing

    prof = Profiler(str(cached_tiny("qwen2.5-vl", tiny_root)), "cpu", QUICK)
    with caplog.at_level(logging.INFO, "hasctl.profile_sharing"):
        points, env = measure_sharing(prof, 1, 1, 1, quick=True)
    assert dict(SHARED_CORES_ENV) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "sharing measured with OMP_WAIT_POLICY=PASSIVE" in caplog.text, caplog.text
    stages = ("encode", "prefill", "decode")
    assert sorted((x.stage, x.by, x.busy) for x in points) == sorted((s, b, 1) for s in stages for b in stages)
    assert all(x.slowdown >= 1.0 and x.cores == 1 for x in points)
    assert sorted(x.stage for x in env) == sorted(stages) and all(x.slowdown > 0 for x in env)


@pytest.mark.slow
def test_the_gateway_points_are_the_gateways_own_preprocessing(tiny_root):
    """`hasctl profile`'s gateway point: a request body as a client sends it, through the
    gateway's own parse and preprocess code and its media decode pool; each phase the live
    gateway reports in /trace is measured (media: CPU of the pool's worker)."""
    import asyncio

    from hasctl.profile_gateway import bodies, gateway_core, preprocess_cpu

    model = str(cached_tiny("qwen2.5-vl", tiny_root))

    async def run():
        core = gateway_core(model)
        await asyncio.to_thread(core.media.pool.start)
        try:
            served = core.cfg.served_model
            image = await preprocess_cpu(core, bodies("image", (56, 56), 1, served)[0])
            text = await preprocess_cpu(core, bodies("text", None, 1, served)[0])
        finally:
            core.media.pool.close()
        return core.media.pool.decodes, image, text

    decodes, image, text = asyncio.run(run())
    assert decodes == 1  # the image was decoded by the gateway's pool, the text had nothing to decode
    assert set(image) == {"parse", "media", "tokenize"} and all(v > 0 for v in image.values()), image
    assert set(text) == {"parse", "tokenize"}, text
