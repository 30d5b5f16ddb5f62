"""`hasctl profile --roofline`: a derived profile/v1 file (revision 3, measured false, tp) from the
paper models' configs and the shipped device specs."""
import json
from pathlib import Path

import pytest

from easerve.roofline import load_spec, spec_names
from easerve import profile_format as pf
from hasctl.cli import main

PAPER = Path(__file__).resolve().parents[2] / "bench" / "paper_models"
GPUS = {"rtx6000-ada", "a100-80g", "h100-sxm", "h200", "l40s", "cpu-epyc-1c", "cpu-epyc-2c"}


def test_shipped_specs_have_sources():
    assert GPUS <= set(spec_names())
    for name in GPUS:
        s = load_spec(name)
        assert s.name == name and len(s.source) > 40 and s.tflops > 0 and s.mem_gb_per_s > 0


def test_spec_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="unknown GPU 'b200'.*shipped specs"):
        load_spec("b200")
    bad = tmp_path / "s.json"
    spec = json.loads((Path(__file__).resolve().parents[2] / "easerve/roofline/specs/h200.json").read_text())
    bad.write_text(json.dumps({**spec, "tflops": 0}))
    with pytest.raises(ValueError, match="tflops must be > 0"):
        load_spec(str(bad))


def test_roofline_profile_file(tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--roofline", "--gpu", "rtx6000-ada", "--tp", "2", "--model",
                 str(PAPER / "qwen2.5-vl-32b"), "--out", str(out)]) == 0
    prof = pf.load(out)
    assert (prof.measured, prof.tp, prof.revision, prof.roofline.device) == (False, 2, 3, "rtx6000-ada")
    assert prof.hardware.gpus == ("rtx6000-ada", "rtx6000-ada")
    assert prof.model.family == "qwen2.5-vl" and prof.model.modalities == ("image", "video")
    # 16 frames of 448x448: 8 temporal steps x 32x32 patches / 4 = 2048 rows
    assert next(p for p in prof.encode.by_size if p.media == "16x448x448").tokens_per_item == 2048
    # decode of a 32B model on two 960 GB/s cards is memory-bound: ~32.6 GB of weights / 2 / (0.8 x 960 GB/s)
    assert 0.035 < prof.decode_step_s(1, 512) < 0.055
    assert prof.encode_latency(8, 1.0) < 8 * prof.encode_latency(1, 1.0)   # batching pays
    assert prof.encode_latency(8, 0.2) > prof.encode_latency(8, 1.0)


def test_tensor_parallel_capacity(tmp_path):
    from hasctl.roofline_profile import build
    model = str(PAPER / "llava-v1.6-34b")
    with pytest.raises(ValueError, match="use --tp 2 or more"):
        build(model, load_spec("rtx6000-ada"), tp=1)
    two, four = (build(model, load_spec("rtx6000-ada"), tp=n) for n in (2, 4))
    assert four.decode_capacity() > 1.5 * two.decode_capacity()
    # PCIe all-reduces keep 4-way prefill from scaling as well as the memory-bound decode
    assert four.prefill_capacity(1024) < 2 * two.prefill_capacity(1024)


def test_measured_profiles_still_load_as_measured(tmp_path):
    from tests.support.profiles import make_profile
    data = make_profile().to_dict()
    for key in ("measured", "tp", "roofline"):
        data.pop(key)                                   # a revision-2 file has none of them
    prof = pf.Profile.from_dict(data)
    assert (prof.measured, prof.tp, prof.roofline) == (True, 1, None)


def test_screen_counts_tensor_parallel_instances(tmp_path, capsys):
    """8 GPUs at tp=2 hold 4 instances: the allocations screen weighs have at most 4 instances,
    and a rate one tp=2 instance of each stage cannot carry needs more of them."""
    out = tmp_path / "p.json"
    main(["profile", "--roofline", "--gpu", "rtx6000-ada", "--tp", "2", "--model", str(PAPER / "qwen2.5-vl-32b"),
          "--out", str(out)])
    capsys.readouterr()
    assert main(["screen", "--profile", str(out), "--rate", "2", "--devices", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["devices"], doc["instance_slots"], doc["tp"]) == (8, 4, 2)
    sizes = {sum(v["allocation"][k] for k in ("encode", "prefill", "decode")) for v in doc["kept"] + doc["removed"]}
    assert max(sizes) == 4


def test_kv_budget_is_what_the_weights_leave_and_sizes_the_simulated_decode():
    """LLaVA-v1.6-34B in bf16 (~69 GB) on 48 GB cards at tp2: ~32 GiB of weights per card leave
    0.9 x 48 - 32 - 1 ~ 10 GiB of KV cache per card (not the simulator's 40 GiB default), so an
    instance holds ~2 x 10 GiB / 240 KiB per token ~ 86k tokens: ~29 requests of 2,976 tokens."""
    from easerve.roofline import load_arch
    from easerve.roofline.models import kv_budget_gib
    from easerve.sim.topology import DEFAULT_GPU_KV_GB
    from hasctl.roofline_profile import build
    from hasctl.simulate import topology
    from hasctl.deployment import Deployment, Worker
    model = str(PAPER / "llava-v1.6-34b")
    arch = load_arch(model)
    weights = (arch.lm.weight_bytes(2) + arch.encoder_weight_bytes(2)) / 2 / 2 ** 30
    assert 31.5 < weights < 33.0
    kv = kv_budget_gib(arch, 48, 2, 2)
    assert kv == pytest.approx(0.9 * 48 - weights - 1.0) and 9 < kv < 11
    assert arch.lm.kv_bytes_per_token(2) == 60 * 2 * 8 * 128 * 2  # 240 KiB
    prof = build(model, load_spec("rtx6000-ada"), tp=2)
    assert prof.roofline.kv_gib_per_device == pytest.approx(kv, abs=1e-3)
    assert pf.Profile.from_dict(prof.to_dict()).roofline.kv_gib_per_device == prof.roofline.kv_gib_per_device
    d = Deployment(name="m", model=model, prefill=(), decode=(), monolith=(Worker(device="cuda:0", tp=2),))
    assert topology(d, prof.roofline.kv_gib_per_device).gpu_kv_gb == pytest.approx(kv, abs=1e-3)
    assert topology(d).gpu_kv_gb == DEFAULT_GPU_KV_GB
    assert 6 < kv_budget_gib(arch, 80, 1, 2) < 7  # one 80 GB card holds it, with a small cache
    with pytest.raises(ValueError, match="no room for a KV cache; use --tp 2 or more"):
        build(model, load_spec("rtx6000-ada"), tp=1)


def test_roofline_profile_states_how_busy_stages_of_one_gpu_slow_each_other():
    """Every ordered pair of GPU stages (a stage with itself too) is listed: a decode step in a
    monolith's engine waits for the prefill chunk scheduled with it (1 + chunk / step, ~8x for
    LLaVA-34B at tp2: a 2,048-token chunk ~0.4 s vs a ~50 ms step), prefill barely slows, and
    the other pairs time-slice the GPU at half speed."""
    from hasctl.roofline_profile import CHUNK_TOKENS, DECODE_REF_BATCH, TIMESLICE_SLOWDOWN, RooflineModel, build
    from easerve.roofline import load_arch
    model = str(PAPER / "llava-v1.6-34b")
    prof = build(model, load_spec("rtx6000-ada"), tp=2)
    stages = ("encode", "prefill", "decode")
    assert {(x.stage, x.by) for x in prof.interference} == {(a, b) for a in stages for b in stages}
    rm = RooflineModel(load_arch(model), load_spec("rtx6000-ada"), 2)
    chunk, step = rm.prefill_s(CHUNK_TOKENS, 1), rm.decode_s(DECODE_REF_BATCH, prof.unloaded[0].prompt_tokens)
    assert 0.3 < chunk < 0.6 and 0.04 < step < 0.07
    assert prof.slowdown("decode", "prefill") == pytest.approx(1 + chunk / step, rel=1e-3)
    assert 6 < prof.slowdown("decode", "prefill") < 12
    assert prof.slowdown("prefill", "decode") == pytest.approx(1 + step / chunk, rel=1e-3)
    assert prof.slowdown("prefill", "decode") < 1.2
    enc = rm.encode_s("image", prof.encode.reference_media, 1)
    assert 0.01 < enc < 0.02  # CLIP ViT-L on LLaVA-NeXT's 5 tiles: a fraction of a decode step
    assert prof.slowdown("decode", "encode") == pytest.approx(1 + enc / step, rel=1e-3)
    assert prof.slowdown("encode", "decode") == pytest.approx(1 + step / enc, rel=1e-3)
    others = [(a, b) for a in stages for b in stages if {a, b} not in ({"decode", "prefill"}, {"decode", "encode"})]
    assert all(prof.slowdown(a, b) == TIMESLICE_SLOWDOWN == 2.0 for a, b in others)


def test_encode_call_overhead_is_paid_once_per_call_and_stalls_the_engines_decode():
    """A stated `encode_call_overhead_s` adds to every encode call once, whatever its batch, is
    written in the profile's `roofline` block, and lengthens the decode step of an engine that
    runs the call inside its step; a negative value is refused with what to change."""
    from dataclasses import replace
    from easerve.roofline import load_arch
    from easerve.roofline.spec import Efficiency
    from hasctl.roofline_profile import RooflineModel, build
    model, base = str(PAPER / "llava-v1.6-34b"), load_spec("rtx6000-ada")
    assert base.efficiency.encode_call_overhead_s == 0.0
    slow = replace(base, efficiency=replace(base.efficiency, encode_call_overhead_s=0.25))
    arch = load_arch(model)
    a, b = RooflineModel(arch, base, 2), RooflineModel(arch, slow, 2)
    for n in (1, 8):
        assert b.encode_s("image", "672x672", n) - a.encode_s("image", "672x672", n) == pytest.approx(0.25)
    assert b.prefill_s(1024, 1) == a.prefill_s(1024, 1) and b.decode_s(8, 1024) == a.decode_s(8, 1024)
    p0, p1 = build(model, base, tp=2), build(model, slow, tp=2)
    assert p1.roofline.encode_call_overhead_s == 0.25 and p0.roofline.encode_call_overhead_s == 0.0
    assert pf.Profile.from_dict(p1.to_dict()).roofline.encode_call_overhead_s == 0.25
    assert p1.unloaded[0].ttft_s - p0.unloaded[0].ttft_s == pytest.approx(0.25)
    assert p1.slowdown("decode", "encode") > 5 > 1.5 > p0.slowdown("decode", "encode")
    with pytest.raises(ValueError, match="encode_call_overhead_s must be >= 0"):
        Efficiency(encode_call_overhead_s=-0.1)
