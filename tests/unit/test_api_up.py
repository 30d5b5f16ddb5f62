"""`hasctl up` / the deployment file: the served model name and --dtype reach the stage argv, and
a tiny random-weight checkpoint is announced as such, with how to serve a real one."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from hasctl import up_cmd
from hasctl.deployment import Deployment, preset, to_commands
from hasctl.launch import assign_ports


def up_args(**kw) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    up_cmd.add_parser(sub)
    p = sub.choices["up"]
    argv = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return p.parse_args(argv)


def gateway_argv(d: Deployment) -> list[str]:
    return list(next(c for c in to_commands(d, "127.0.0.1", assign_ports(d, "127.0.0.1", None)) if c.stage == "gateway").argv)


def test_served_model_name_from_hasctl_up_reaches_the_gateway():
    d = up_cmd.resolve(up_args(model="/models/qwen", served_model_name="qwen-vl"))
    argv = gateway_argv(d)
    assert argv[argv.index("--served-model-name") + 1] == "qwen-vl"
    assert "--served-model-name" not in gateway_argv(up_cmd.resolve(up_args(model="/models/qwen")))


def test_served_model_name_in_the_deployment_file(tmp_path):
    path = dataclasses.replace(preset("default"), served_model_name="my-model").with_model("/m").dump(tmp_path / "d.json")
    assert json.loads(path.read_text())["served_model_name"] == "my-model"
    d = Deployment.load(path)
    assert d.served_model_name == "my-model"
    argv = gateway_argv(d)
    assert argv[argv.index("--served-model-name") + 1] == "my-model"
    flag = up_cmd.resolve(up_args(deployment=path, served_model_name="other"))  # the flag wins
    assert flag.served_model_name == "other"
    with pytest.raises(ValueError, match="served_model_name must be a string"):
        Deployment(served_model_name=5)


def test_dtype_from_hasctl_up_reaches_every_stage():
    d = up_cmd.resolve(up_args(model="/m", dtype="bfloat16", preset="colocated"))
    for c in to_commands(d, "127.0.0.1", assign_ports(d, "127.0.0.1", None)):
        if c.stage != "gateway":
            assert c.argv[c.argv.index("--dtype") + 1] == "bfloat16", c.name


def test_tiny_checkpoints_are_announced_with_how_to_serve_a_real_model(tmp_path, capsys):
    from easerve.models.tiny.build import MARKER, is_tiny, tiny_notice

    real = tmp_path / "real"
    real.mkdir()
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / MARKER).write_text('{"family": "qwen2.5-vl"}')
    assert is_tiny(tiny) and not is_tiny(real)
    up_cmd._notice_if_tiny(str(real))
    assert capsys.readouterr().out == ""
    up_cmd._notice_if_tiny(str(tiny))
    out = capsys.readouterr().out
    assert out.strip() == tiny_notice(tiny) and "RANDOM weights" in out and "noise" in out and "--model" in out


def test_admission_flags_of_hasctl_up_reach_the_gateway(tmp_path):
    prof = tmp_path / "prof.json"
    argv = gateway_argv(up_cmd.resolve(up_args(model="/models/qwen", admission="reject", profile=prof,
                                               slo_tier="tight")))
    assert argv[argv.index("--admission") + 1] == "reject"
    assert argv[argv.index("--slo-tier") + 1] == "tight"
    assert argv[argv.index("--profile") + 1] == str(prof.resolve())
    assert "--admission" not in gateway_argv(up_cmd.resolve(up_args(model="/models/qwen")))


def test_admission_without_a_profile_is_refused_naming_both_flags():
    from easerve.stages.common.configs import GatewayConfig
    with pytest.raises(ValueError, match="--admission reject needs --profile"):
        GatewayConfig(model="m", prefill=("a:1",), decode=("a:2",), admission="reject")
    with pytest.raises(ValueError, match="--admission"):
        GatewayConfig(model="m", prefill=("a:1",), decode=("a:2",), admission="sometimes")
