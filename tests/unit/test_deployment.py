"""Deployment files and presets: validation, round trips, the processes they describe."""
from __future__ import annotations

import json
import re

import pytest

from hasctl.deployment import (FLAGS, PRESETS, Deployment, GatewaySpec, Worker, preset, process_names,
                               to_commands)

MODEL = "/models/tiny"


def _ports(d: Deployment) -> dict[str, int]:
    return {n: 41000 + i for i, n in enumerate(process_names(d))}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_round_trip(name, tmp_path):
    d = preset(name)
    assert d.name == name
    if name == "monolith":
        assert len(d.monolith) == 1 and not (d.encode or d.prefill or d.decode)
    else:
        assert len(d.encode) == len(d.prefill) == len(d.decode) == 1 and not d.monolith
    for suffix in (".json", ".yaml", ".yml"):
        assert Deployment.load(d.dump(tmp_path / f"d{suffix}")) == d


def test_presets_hold_the_baselines():
    knobs = {n: (d.encode[0].flag("batch-mode"), d.encode[0].flag("max-batch"), d.encode[0].flag("remote-fraction"),
                 bool(d.encode[0].flag("colocate-prefill"))) for n, d in PRESETS.items() if d.encode}
    assert knobs == {"default": ("continuous", 8, 1.0, False), "colocated": ("continuous", 8, 0.5, True),
                     "dynamo-like": ("request_at_a_time", 1, 1.0, False), "fixed-batch-8": ("fixed", 8, 1.0, False)}
    assert preset("passthrough") == preset("dynamo-like") and preset("fixed8") == preset("fixed-batch-8")
    mono = preset("monolith").monolith[0]
    assert mono.flag("sm-backend") == "timeslice"  # the aggregated baseline shares nothing on purpose


@pytest.mark.parametrize("name, stage", [("default", "encode"), ("colocated", "encode"), ("monolith", "monolith")])
def test_presets_with_an_idle_encoder_dispatch_at_once(name, stage):
    """The encoder of these presets may sit idle: a lone request leaves the moment it arrives
    (no gap or cap wait), and arrivals during a busy encode still leave together, up to 8."""
    from easerve.policy.batcher import AdaptiveBatcher
    cmd = next(c for c in to_commands(preset(name).with_model(MODEL), "127.0.0.1", _ports(preset(name)))
               if c.stage == stage)
    b = AdaptiveBatcher(_parse(stage, list(cmd.argv[3:])).batcher)
    d = b.add("lone", 0.0)
    assert d is not None and d.item_ids == ("lone",) and d.oldest_wait_s == 0.0
    for i in range(10):
        assert b.add(i, 0.01 * i) is None  # the encoder is busy: they wait together
    b.on_free(0.2)
    assert b.poll(0.2).item_ids == tuple(range(8))


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="default"):
        preset("nope")


def test_custom_round_trip_keeps_everything(tmp_path):
    d = Deployment(model="m", name="tuned", gateway=GatewaySpec(1234, 1235, {"request-timeout-s": 30.0}),
                   encode=(Worker("cuda:0", 7000, {"max-batch": 4, "remote-fraction": 0.25,
                                                   "colocate-prefill": True}),) * 1,
                   prefill=(Worker("cuda:1", 7001), Worker("cuda:2", 7002)),
                   decode=(Worker("cuda:3", 7003, {"max_running": 32}),))
    assert d.decode[0].flag("max-running") == 32  # python names are accepted
    assert Deployment.load(d.dump(tmp_path / "t.yaml")) == d
    assert Deployment.from_dict(json.loads(d.dumps())) == d


@pytest.mark.parametrize("text, match", [
    ('{"decode": [{"device": "tpu"}]}', r"decode\[0\]\.device"),
    ('{"encode": [{"flags": {"max-batch": 0}}]}', "max-batch"),
    ('{"encode": [{"flags": {"remote-fraction": 1.5}}]}', "remote-fraction"),
    ('{"encode": [{"flags": {"remote-fraction": 0.5}}]}', "colocate-prefill"),
    ('{"encode": [{"flags": {"batch-mode": "greedy"}}]}', "batch-mode"),
    ('{"decode": [{"device": "cpu:a-b"}]}', r"decode\[0\]\.device"),
    ('{"encode": [{"flags": {"batch-mode": "request_at_a_time"}}]}', "max-batch 1"),
    ('{"encode": [{"flags": {"prefill": "h:1"}}]}', "unknown flag 'prefill'"),
    ('{"decode": [{"flags": {"max-running": [1]}}]}', "string, number or boolean"),
    ('{"decode": []}', "at least one decode"),
    ('{"prefill": [{"port": 70000}]}', r"prefill\[0\]\.port"),
    ('{"prefill": [{"port": 9000}], "decode": [{"port": 9000}]}', r"\[9000\]"),
    ('{"gateway": {"grpc_port": 9000, "http_port": 9000}}', r"\[9000\]"),
    ('{"decoder": []}', "unknown key"),
    ('{"decode": [{"gpu": 1}]}', "unknown key"),
    ('{"decode": {"device": "cpu"}}', "must be a list"),
    ('[1, 2]', "must be a mapping"),
    ('{"decode": [', "not valid JSON"),
])
def test_bad_files_say_what_to_change(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Deployment.load(path)


@pytest.mark.parametrize("text, where", [
    ("decode: [device: cpu\n", r"line 2, column 1: expected ',' or '\]'"),
    ("name: x\n\tdecode: []\n", r"line 2, column 1: found character '\\t'"),
])
def test_a_yaml_syntax_error_says_so_with_the_line(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad.yaml is not valid YAML \({where}.*\); fix it"):
        Deployment.load(path)


@pytest.mark.parametrize("text, match", [
    ("decode: [{flags: {max-running: abc}}]\n", r"decode\[0\]\.flags\.max-running must be an integer, got 'abc'"),
    ("decode: [{device: cpu, port: 99999}]\n", r"decode\[0\]\.port must be an int in 0\.\.65535"),
    ("encode: [{flags: {max-batch: 0}}]\n", r"encode\[0\]: --max-batch must be >= 1, got 0"),
    ("decoder: []\n", r"top level: unknown key\(s\) \['decoder'\]; allowed: \['decode'"),
    ("gateway: {grpc_port: 50051, flags: {max-runing: 1}}\n", r"gateway\.flags: unknown flag 'max-runing'"),
    ("model: 2024-13-45\ndecode: []\n", "at least one decode"),  # a date-like value is a plain string
])
def test_a_yaml_file_that_parses_but_breaks_a_rule_names_the_key_not_the_syntax(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*{match}") as e:
        Deployment.load(path)
    assert "not valid" not in str(e.value)


def test_unreadable_files_say_why(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        Deployment.load(tmp_path / "missing.yaml")
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.yaml is not UTF-8 text \(byte 9\); save it as UTF-8"):
        Deployment.load(path)


def test_frozen_and_derived_copies():
    d = preset("default")
    with pytest.raises(AttributeError):
        d.model = "x"  # type: ignore[misc]
    e = d.with_model(MODEL).with_device("cuda:0").with_flags("decode", max_running=8).with_gateway_ports(0, 0)
    assert d.model == "" and d.decode[0].device == "cpu"
    assert e.model == MODEL and {w.device for w in e.workers()} == {"cuda:0"}
    assert e.decode[0].flag("max-running") == 8 and e.gateway.grpc_port == 0


def test_commands_are_ordered_and_wired():
    d = preset("colocated").with_model(MODEL).with_flags("decode", num_slots=4)
    ports = _ports(d)
    cmds = to_commands(d, "0.0.0.0", ports, python="py")
    assert [c.name for c in cmds] == ["decode-0", "prefill-0", "encode-0", "gateway"]
    assert [c.argv[:3] for c in cmds][0] == ("py", "-m", "services.decode")
    argv = {c.name: " ".join(c.argv) for c in cmds}
    dec, pre, enc = (f"127.0.0.1:{ports[n]}" for n in ("decode-0", "prefill-0", "encode-0"))
    assert f"--listen 0.0.0.0:{ports['decode-0']}" in argv["decode-0"] and "--num-slots 4" in argv["decode-0"]
    assert f"--decode {dec}" in argv["prefill-0"]
    assert f"--prefill {pre}" in argv["encode-0"] and f"--decode {dec}" in argv["encode-0"]
    assert "--colocate-prefill" in argv["encode-0"] and "--remote-fraction 0.5" in argv["encode-0"]
    assert f"--encode {enc} --prefill {pre} --decode {dec}" in argv["gateway"]
    assert f"--http-listen 0.0.0.0:{ports['gateway-http']}" in argv["gateway"]


def test_commands_need_a_model_and_every_port():
    with pytest.raises(ValueError, match="no model"):
        to_commands(preset("default"), "127.0.0.1", _ports(preset("default")))
    d = preset("default").with_model(MODEL)
    with pytest.raises(ValueError, match="no port"):
        to_commands(d, "127.0.0.1", {})


SAMPLE = {"grace-s": 1.0, "drain-timeout-s": 30.0, "threads": 1, "log-level": "INFO", "dtype": "float32", "max-running": 4, "max-waiting": 8, "num-slots": 4,
          "max-seq-len": 256, "kv-capacity-tokens": 1024, "block-size": 16, "kv-transport": "auto", "embed-transport": "shm", "kv-rendezvous": "127.0.0.1:0",
          "colocate-prefill": True, "remote-fraction": 0.5, "max-batch": 4, "batch-mode": "fixed",
          "safety-cap-s": 0.5, "gap-coef": 2.0, "served-model-name": "m", "request-timeout-s": 30.0,
          "default-max-tokens": 16, "max-body-mb": 8.0, "max-gap-s": 0.05, "sm-backend": "auto",
          "partition-policy": "dynamic", "partition-profile": "/tmp/p.json", "profile-batch-sizes": "1,2",
          "partition-tolerance": 0.1, "metrics-listen": "127.0.0.1:9100", "max-inflight": 64,
          "max-model-len": 2048, "max-batched-tokens": 512, "max-prefill-batch": 4,
          "preprocess-threads": 1, "allowed-media-domains": "127.0.0.1,*.example.com",
          "allowed-local-media-path": "/srv/media", "media-max-mb": 8.0, "media-timeout-s": 5.0,
          "media-max-mpixels": 64.0, "kv-cache-memory-gb": 0.5, "gpu-memory-utilization": 0.8,
          "encoder-cache-gb": 0.5, "media-hash-entries": 128, "encoder-cache-affinity": 2,
          "max-message-mb": 64.0, "tls-cert": "/etc/easerve/tls.crt", "tls-key": "/etc/easerve/tls.key",
          "tls-ca": "/etc/easerve/ca.crt", "tls-client-auth": True, "api-key-file": "/etc/easerve/api-keys",
          "peer-refresh-s": 2.0, "admission": "reject", "slo-tier": "tight", "priority": "batch",
          "profile": "/etc/easerve/profile.json", "admission-encode-batch": 4, "admission-prefill-tokens": 512, "admission-probe-s": 2.0, "no-admission-calibration": True,
          "no-prefix-cache": True, "prefix-cache-gb": 0.5, "prefix-block-tokens": 32,
          "online": True, "online-batch": "2:16", "online-remote-fraction": "0.2:1",
          "online-tolerance": "0:0.3", "online-instances": "1:2", "online-window-s": 10.0, "online-dwell-s": 20.0, "stream-interval-ms": 10.0,
          "online-instances-file": "/tmp/instances.json", "online-util": "0.3:0.6:0.9",
          "migration-limit": 2, "decode-progress-timeout-s": 10.0, "media-workers": 2, "media-queue": 32}


def _parse(stage: str, argv: list[str]):
    from easerve.stages.common.configs import STAGE_CONFIGS
    from easerve.stages.common.argv import from_argv
    return from_argv(STAGE_CONFIGS[stage], stage, argv)  # argparse exits (SystemExit) on an unknown flag


def test_commands_are_accepted_by_the_stage_parsers():
    everything = Deployment(model=MODEL, encode=(Worker(flags={f: SAMPLE[f] for f in FLAGS["encode"]}),),
                            prefill=(Worker(flags={f: SAMPLE[f] for f in FLAGS["prefill"]}),),
                            decode=(Worker(flags={f: SAMPLE[f] for f in FLAGS["decode"]}),),
                            gateway=GatewaySpec(flags={f: SAMPLE[f] for f in FLAGS["gateway"]}))
    multi = Deployment(model=MODEL, encode=(Worker("cpu:0"), Worker("cpu:1")), prefill=(Worker(), Worker()),
                       decode=(Worker("cpu:0-1"), Worker()))
    for d in [everything, multi, *(p.with_model(MODEL) for p in PRESETS.values())]:
        for c in to_commands(d, "127.0.0.1", _ports(d), python="py"):
            cfg = _parse(c.stage, list(c.argv[3:]))
            assert cfg.model == MODEL and cfg.listen == f"127.0.0.1:{c.port}"


def test_several_instances_are_all_wired():
    d = Deployment(model=MODEL, encode=(Worker(), Worker()), prefill=(Worker(), Worker(), Worker()),
                   decode=(Worker("cpu:0"), Worker("cpu:1")))
    ports = _ports(d)
    cmds = {c.name: _parse(c.stage, list(c.argv[3:])) for c in to_commands(d, "127.0.0.1", ports)}
    addr = lambda s, n: tuple(f"127.0.0.1:{ports[f'{s}-{i}']}" for i in range(n))  # noqa: E731
    assert cmds["gateway"].encode == addr("encode", 2) and cmds["gateway"].decode == addr("decode", 2)
    assert cmds["gateway"].prefill == addr("prefill", 3)
    assert all(cmds[f"prefill-{i}"].decode == addr("decode", 2) for i in range(3))
    assert cmds["encode-1"].prefill == addr("prefill", 3) and cmds["decode-1"].device == "cpu:1"


def test_monolith_serves_every_stage_to_the_gateway():
    d = preset("monolith").with_model(MODEL)
    ports = _ports(d)
    cmds = {c.name: c for c in to_commands(d, "127.0.0.1", ports)}
    assert set(cmds) == {"monolith-0", "gateway"}
    gw = _parse("gateway", list(cmds["gateway"].argv[3:]))
    me = (f"127.0.0.1:{ports['monolith-0']}",)
    assert gw.encode == gw.prefill == gw.decode == me
    mono = _parse("monolith", list(cmds["monolith-0"].argv[3:]))
    assert mono.colocate_prefill and mono.remote_fraction == 0.0


@pytest.mark.parametrize("stage", ["decode", "prefill", "encode", "monolith", "gateway"])
def test_deployment_flags_are_the_stage_configs_own(stage):
    """A field a stage config grows is settable from a deployment file (unless the launcher
    wires it), and the generated parser knows exactly the config's fields."""
    import dataclasses

    from easerve.fields import is_flag
    from easerve.stages.common.configs import STAGE_CONFIGS
    from easerve.stages.common.argv import parser
    every = dataclasses.fields(STAGE_CONFIGS[stage])
    fields = {f.name.replace("_", "-"): f for f in every if is_flag(f)}
    options = {o[2:] for a in parser(STAGE_CONFIGS[stage], stage)._actions for o in a.option_strings
               if o.startswith("--")} - {"help"}
    assert options == set(fields)
    # only the engine's own choices are no flags (EngineConfig: for tests and benchmarks)
    assert {f.name for f in every if not is_flag(f)} == ({"kv_layout", "linear_layout"}
                                                         if stage in ("decode", "monolith") else set())
    assert set(FLAGS[stage]) == {n for n, f in fields.items() if not f.metadata["wired"]}
    assert {"model", "listen", "device"} <= set(fields) - set(FLAGS[stage])


def test_every_bench_deployment_file_loads():
    from pathlib import Path
    files = sorted((Path(__file__).resolve().parents[2] / "bench" / "deployments").glob("*.yaml"))
    assert len(files) >= 3
    for f in files:
        d = Deployment.load(f)
        assert d.name == f.stem, f
        assert d.decode and d.prefill and d.encode, f


def _envs(d: Deployment) -> dict[str, dict]:
    from hasctl.deployment import process_names, to_commands
    cmds = to_commands(d.with_model("/m"), "127.0.0.1", {n: 9000 + i for i, n in enumerate(process_names(d))})
    return {c.name: dict(c.env) for c in cmds}


def test_workers_sharing_cpu_cores_get_passive_openmp_threads_and_the_others_do_not():
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    shared = Deployment(encode=(Worker(device="cpu:0-1"),), prefill=(Worker(device="cpu:0-1"),),
                        decode=(Worker(device="cpu:1"),))
    assert _envs(shared) == {"encode-0": passive, "prefill-0": passive, "decode-0": passive, "gateway": {}}
    split = Deployment(encode=(Worker(device="cpu:0"),), prefill=(Worker(device="cpu:1"),),
                       decode=(Worker(device="cpu:2-3"),))
    assert _envs(split) == {"encode-0": {}, "prefill-0": {}, "decode-0": {}, "gateway": {}}
    mixed = Deployment(encode=(Worker(device="cpu:0"),), prefill=(Worker(device="cpu:0"),),
                       decode=(Worker(device="cpu:1"),))
    assert _envs(mixed)["decode-0"] == {} and _envs(mixed)["encode-0"] == passive
    assert _envs(preset("monolith")) == {"monolith-0": {}, "gateway": {}}  # one process: nothing shared
    unpinned = _envs(preset("dynamo-like"))  # plain `cpu`: every core, so shared with the others
    assert all(unpinned[n] == passive for n in ("encode-0", "prefill-0", "decode-0"))
    gpus = Deployment(encode=(Worker(device="cuda:0"),), prefill=(Worker(device="cuda:0"),),
                      decode=(Worker(device="cuda:1"),))
    assert all(v == {} for v in _envs(gpus).values())
