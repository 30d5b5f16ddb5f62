"""hasctl.tune_space: which allocations are candidates, and the Deployment each point becomes."""
from __future__ import annotations

import optuna
import pytest

from hasctl.deployment import Deployment
from hasctl.screen import Allocation
from hasctl.tune_space import (MONOLITH, MONOLITH_DP, Space, _all_of, core_devices, deployment_for,
                               runnable_allocations, suggest, warm_starts)

DEVS = ("cpu:0", "cpu:1")


def test_runnable_allocations_need_a_prefill_worker():
    assert [a.name for a in runnable_allocations(3)] == ["E1-P1-D1", "E1-P1-D1+coloc"]
    four = {a.name for a in runnable_allocations(4)}
    assert {"E2-P1-D1", "E1-P2-D1", "E1-P1-D2", "E2-P1-D1+coloc", "E1-P1-D1"} <= four
    assert all(a.prefill >= 1 and a.encode >= 1 for a in runnable_allocations(5))
    assert "E1-P0-D1+coloc" not in {a.name for a in runnable_allocations(4)}
    with pytest.raises(ValueError, match="instances must be >= 2"):
        runnable_allocations(1)


def test_colocated_point_round_robins_the_cores():
    space = Space(tuple(runnable_allocations(3)), DEVS)
    d = deployment_for(space, {"alloc": "E1-P1-D1+coloc", "B": 4, "s": 0.3}, "/m", name="t")
    assert [w.device for w in d.encode + d.prefill + d.decode] == ["cpu:0", "cpu:1", "cpu:0"]
    enc = d.encode[0]
    assert enc.flag("colocate-prefill") is True and enc.flag("remote-fraction") == 0.3 and enc.flag("max-batch") == 4
    assert enc.flag("batch-mode") == "adaptive"
    assert (d.gateway.grpc_port, d.gateway.http_port) == (0, 0) and d.model == "/m" and d.name == "t"
    with pytest.raises(ValueError, match="params need 's'"):
        deployment_for(space, {"alloc": "E1-P1-D1+coloc", "B": 4}, "/m")


def test_disaggregated_point_sends_everything_to_remote_prefill():
    space = Space(tuple(runnable_allocations(4)), ("cpu:0", "cpu:1", "cpu:2"))
    d = deployment_for(space, {"alloc": "E1-P1-D2", "B": 16}, "/m")
    assert [w.device for w in d.encode + d.prefill + d.decode] == ["cpu:0", "cpu:1", "cpu:2", "cpu:0"]
    assert d.encode[0].flag("colocate-prefill") is None and d.encode[0].flag("remote-fraction") == 1.0
    assert Deployment.from_dict(d.to_dict()) == d  # the file round-trips


def test_the_batch_mode_is_part_of_the_point():
    space = Space(tuple(runnable_allocations(3)), DEVS)
    assert space.batch_modes == ("adaptive", "fixed", "request_at_a_time", "continuous")
    d = deployment_for(space, {"alloc": "E1-P1-D1", "mode": "continuous", "B": 16}, "/m")  # flags checked by EncodeConfig
    assert d.encode[0].flag("batch-mode") == "continuous" and d.encode[0].flag("max-batch") == 16
    rat = deployment_for(space, {"alloc": MONOLITH, "mode": "request_at_a_time"}, "/m")
    assert rat.monolith[0].flag("batch-mode") == "request_at_a_time" and rat.monolith[0].flag("max-batch") == 1
    with pytest.raises(ValueError, match="not in this search space"):
        deployment_for(Space((), DEVS, batch_modes=("adaptive",)), {"alloc": MONOLITH, "mode": "fixed", "B": 2}, "/m")
    with pytest.raises(ValueError, match="needs 'B'"):
        deployment_for(space, {"alloc": "E1-P1-D1", "mode": "fixed"}, "/m")
    with pytest.raises(ValueError, match="batch_modes must be"):
        Space((), DEVS, batch_modes=("greedy",))


def test_monolith_point_takes_every_core():
    space = Space((), ("cpu:0", "cpu:1", "cpu:3"))
    d = deployment_for(space, {"alloc": MONOLITH, "B": 2}, "/m")
    assert not d.encode and not d.prefill and not d.decode
    (m,) = d.monolith
    assert m.device == "cpu:0-1,3" and m.flag("max-batch") == 2 and m.flag("sm-backend") == "timeslice"
    assert _all_of(("cuda:1", "cuda:0")) == "cuda:1"


def test_on_several_gpus_the_vllm_like_layout_is_a_point_of_the_space_and_tried_first():
    """monolith-dp: one monolith replica per tensor-parallel group (4 x tp2 on 8 GPUs), as the
    vLLM-like baseline runs; warm-started before the Dynamo-like layout and the presets' points."""
    gpus = ("cuda:0", "cuda:2", "cuda:4", "cuda:6")
    space = Space(tuple(runnable_allocations(4)), gpus, tp=2, dynamo_alloc="E1-P1-D2", screened_best="E2-P1-D1+coloc")
    assert space.choices[-2:] == (MONOLITH, MONOLITH_DP)
    d = deployment_for(space, {"alloc": MONOLITH_DP, "mode": "adaptive", "B": 8}, "/m")
    assert [(w.device, w.tp, w.flag("max-batch")) for w in d.monolith] == [(g, 2, 8) for g in gpus]
    assert not d.encode and not d.prefill and not d.decode
    assert [w.device for w in deployment_for(space, {"alloc": MONOLITH, "B": 8}, "/m").monolith] == ["cuda:0"]
    warm = warm_starts(space)
    assert warm[:3] == [{"alloc": MONOLITH_DP, "mode": "continuous", "B": 8},
                        {"alloc": "E1-P1-D2", "mode": "request_at_a_time"},
                        {"alloc": "E2-P1-D1+coloc", "mode": "continuous", "B": 16, "s": 0.5}]
    assert len(warm) == len({str(p) for p in warm})  # no point twice
    # one device, or CPU cores: no data-parallel point (the monolith already takes every core)
    assert MONOLITH_DP not in Space((), ("cuda:0",)).choices and MONOLITH_DP not in Space((), DEVS).choices
    with pytest.raises(ValueError, match="not in this search space"):
        Space((), DEVS).allocation(MONOLITH_DP)
    with pytest.raises(ValueError, match="dynamo_alloc 'E9-P1-D1' is not one of the allocations"):
        Space(tuple(runnable_allocations(4)), gpus, dynamo_alloc="E9-P1-D1")


def test_space_rejects_what_cannot_run():
    with pytest.raises(ValueError, match="at least one device"):
        Space((), ())
    with pytest.raises(ValueError, match="cannot run"):
        Space((Allocation(1, 0, 1, True),), DEVS)
    with pytest.raises(ValueError, match="empty"):
        Space((), DEVS, monolith=False)
    with pytest.raises(ValueError, match="device must be"):
        Space((), ("gpu0",))
    with pytest.raises(ValueError, match="not in this search space"):
        Space((), DEVS).allocation("E9-P9-D9")
    assert core_devices([1, 0, 1]) == ("cpu:0", "cpu:1")


def test_suggest_draws_s_only_for_colocated_allocations():
    space = Space(tuple(runnable_allocations(3)), DEVS)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen, modes = set(), set()
    for _ in range(30):
        t = study.ask()
        p = suggest(t, space)
        seen.add(p["alloc"])
        modes.add(p["mode"])
        assert p["mode"] in space.batch_modes
        assert ("B" in p) == (p["mode"] != "request_at_a_time")
        assert p.get("B", 1) in space.batch_sizes
        assert ("s" in p) == p["alloc"].endswith("+coloc")
        if "s" in p:
            assert 0.0 <= p["s"] <= 1.0 and round(p["s"] / 0.05, 6) == round(p["s"] / 0.05)
        deployment_for(space, p, "/m")  # every point is a valid Deployment
        study.tell(t, 0.0)
    assert seen == set(space.choices)


def test_text_only_workload_may_skip_encode():
    names = {a.name for a in runnable_allocations(3, media=False)}
    assert {"E0-P1-D1", "E0-P2-D1", "E0-P1-D2", "E1-P1-D1"} <= names
    d = deployment_for(Space(tuple(runnable_allocations(3, media=False)), DEVS), {"alloc": "E0-P2-D1", "B": 1}, "/m")
    assert not d.encode and [w.device for w in d.prefill + d.decode] == ["cpu:0", "cpu:1", "cpu:0"]


def test_shared_placement_puts_every_stage_on_all_cores():
    space = Space(tuple(runnable_allocations(3)), DEVS, placements=("split", "shared"))
    d = deployment_for(space, {"alloc": "E1-P1-D1+coloc", "B": 8, "s": 0.0, "place": "shared", "decode_threads": 1},
                       "/m")
    assert [w.device for w in d.encode + d.prefill + d.decode] == ["cpu:0-1"] * 3
    assert [w.flag("threads") for w in d.encode + d.prefill + d.decode] == [2, 2, 1]
    assert d.encode[0].flag("remote-fraction") == 0.0 and d.encode[0].flag("colocate-prefill") is True
    assert d.encode[0].flag("sm-backend") is None  # no `sm` drawn: the stage's default
    ts = deployment_for(space, {"alloc": "E1-P1-D1+coloc", "B": 8, "s": 0.0, "place": "shared", "decode_threads": 2,
                                "sm": "timeslice"}, "/m")
    assert ts.encode[0].flag("sm-backend") == "timeslice" and ts.encode[0].flag("partition-policy") == "timeslice"
    assert ts.decode[0].flag("threads") == 2
    split = deployment_for(space, {"alloc": "E1-P1-D1", "B": 8, "place": "split"}, "/m")
    assert [w.device for w in split.encode + split.prefill + split.decode] == ["cpu:0", "cpu:1", "cpu:0"]
    assert all(w.flag("threads") is None for w in split.workers())
    with pytest.raises(ValueError, match="decode_threads must be in 1..2"):
        deployment_for(space, {"alloc": "E1-P1-D1", "B": 8, "place": "shared", "decode_threads": 3}, "/m")
    with pytest.raises(ValueError, match="not in this search space"):
        deployment_for(Space(tuple(runnable_allocations(3)), DEVS), {"alloc": "E1-P1-D1", "B": 8, "place": "shared"},
                       "/m")
    with pytest.raises(ValueError, match="placements must be"):
        Space((), DEVS, placements=("everywhere",))


def test_suggest_draws_place_and_decode_threads_for_allocations_only():
    space = Space(tuple(runnable_allocations(3)), DEVS, placements=("split", "shared"))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    seen = set()
    for _ in range(40):
        t = study.ask()
        p = suggest(t, space)
        if p["alloc"] == MONOLITH:
            assert "place" not in p and "decode_threads" not in p
        else:
            seen.add(p["place"])
            assert ("decode_threads" in p) == (p["place"] == "shared")
            assert ("sm" in p) == (p["place"] == "shared" and p["alloc"].endswith("+coloc"))
            assert p.get("decode_threads", 1) in (1, 2)
        deployment_for(space, p, "/m")
        study.tell(t, 0.0)
    assert seen == {"split", "shared"}
