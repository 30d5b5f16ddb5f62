"""hasctl/profile_host.py: host CPU per request per stage from process CPU, and what the
simulator takes from a host-work file."""
from __future__ import annotations

import os

import pytest

from hasctl.deployment import preset
from hasctl.profile_host import host_s_for, per_stage, spec_for, stage_of, tree_cpu_s
from tests.support.profiles import make_profile


def test_stage_of_names_the_process_stage():
    assert [stage_of(n) for n in ("encode-1", "prefill-0", "decode-12", "gateway", "monolith-0")] == \
        ["encode", "prefill", "decode", "gateway", "monolith"]
    with pytest.raises(ValueError, match="no stage"):
        stage_of("router-0")


def test_per_stage_subtracts_the_idle_rate_and_sums_instances():
    """Two encode instances: 1.0 + 0.6 s of CPU over a 10 s run, idling at 0.01 and 0.02 core-s/s:
    (0.9 + 0.4) / 20 requests = 65 ms per request; a process below its idle rate counts 0."""
    out = per_stage({"encode-0": 1.0, "encode-1": 0.6, "gateway": 0.05},
                    {"encode-0": 0.01, "encode-1": 0.02, "gateway": 0.01}, wall_s=10.0, completed=20)
    assert out == pytest.approx({"encode": 0.065, "gateway": 0.0})


def test_tree_cpu_counts_this_process():
    t0 = tree_cpu_s([os.getpid()])
    sum(i * i for i in range(2_000_000))
    assert tree_cpu_s([os.getpid()]) > t0


def test_host_s_for_takes_the_preset_measured_for_the_shape():
    doc = {"default": {"host_s": {"gateway": 0.010, "encode": 0.004, "prefill": 0.003, "decode": 0.02}},
           "monolith": {"host_s": {"gateway": 0.011, "monolith": 0.03}}}
    prof = make_profile()  # revision 1: no gateway preprocessing to take off
    assert dict(host_s_for(doc, preset("default"), prof, "image")) == doc["default"]["host_s"]
    assert dict(host_s_for(doc, preset("monolith"), prof, "image")) == doc["monolith"]["host_s"]
    with pytest.raises(ValueError, match="re-run hasctl profile --host-work"):
        host_s_for({"default": doc["default"]}, preset("monolith"), prof, "image")


def test_spec_for_is_the_profiles_reference_media():
    spec = spec_for(make_profile(), output_tokens=8)
    assert (spec.modality, spec.image_size, spec.output_tokens) == ("image", (224, 224), 8)
