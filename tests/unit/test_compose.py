"""docker-compose.yml (+ the CPU override) describes a stack the stages accept, and
`python -m easerve.healthcheck` reports grpc health as an exit code."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from easerve import healthcheck

ROOT = Path(__file__).resolve().parents[2]
MAIN, CPU = ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"
STAGES = ("decode", "prefill", "encode")
HEALTH = {"decode": "easerve.v1.Decode", "prefill": "easerve.v1.Prefill", "encode": "easerve.v1.Encode",
          "gateway": "easerve.v1.Gateway"}


class _Reset:
    pass


class _Loader(yaml.SafeLoader):
    """Understands compose's merge tags: !reset drops a key, !override replaces it."""


_Loader.add_constructor("!reset", lambda loader, node: _Reset())
_Loader.add_constructor("!override", lambda loader, node: (
    loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node, deep=True)))


def _interpolate(value):
    """${VAR:-default} -> default (no environment read: the file's own defaults are checked)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, _Reset):
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load(*files: Path) -> dict:
    doc: dict = {}
    for f in files:
        doc = _merge(doc, yaml.load(f.read_text(), Loader=_Loader))
    return _interpolate(doc)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _has_compose() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="docker compose is not installed; the YAML checks below still run")
@pytest.mark.parametrize("files", [(MAIN,), (MAIN, CPU)], ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(files):
    args = [a for f in files for a in ("-f", str(f))]
    r = subprocess.run(["docker", "compose", *args, "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("files", [(MAIN,), (MAIN, CPU)], ids=["gpu", "cpu"])
def test_services_are_complete_and_wired(files):
    svc = load(*files)["services"]
    assert set(svc) == {"model-init", *STAGES, "gateway"}
    for name, s in svc.items():
        assert isinstance(s.get("command"), list) and s["command"], name
        for dep in s.get("depends_on", {}):
            assert dep in svc, f"{name} depends on unknown service {dep}"
        if name == "model-init":
            continue
        assert s["depends_on"]["model-init"]["condition"] == "service_completed_successfully", name
        assert any(v.endswith(":/models") for v in s["volumes"]), name
        port = _flag(s["command"], "--listen").rpartition(":")[2]
        test = s["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "easerve.healthcheck"], name
        assert test[4:] == [f"127.0.0.1:{port}", HEALTH[name]], name
    gw = svc["gateway"]
    assert {d: c["condition"] for d, c in gw["depends_on"].items() if d != "model-init"} == \
        {s: "service_healthy" for s in STAGES}
    assert {p.rpartition(":")[2] for p in gw["ports"]} == {"50051", "8000"}
    assert svc["prefill"]["depends_on"]["decode"]["condition"] == "service_healthy"
    assert svc["encode"]["depends_on"]["prefill"]["condition"] == "service_healthy"


def test_peer_addresses_name_services_and_their_ports():
    svc = load(MAIN)["services"]
    listen = {n: _flag(svc[n]["command"], "--listen").rpartition(":")[2] for n in (*STAGES, "gateway")}
    for name in (*STAGES, "gateway"):
        cmd = svc[name]["command"]
        for flag in ("--decode", "--prefill", "--encode"):
            for addr in filter(None, (_flag(cmd, flag) or "").split(",")):
                host, _, port = addr.rpartition(":")
                assert host in svc and port == listen[host], f"{name} {flag} {addr}"


def test_gpu_reservations_and_the_cpu_override():
    gpu, cpu = load(MAIN)["services"], load(MAIN, CPU)["services"]
    for name in STAGES:
        (dev,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert _flag(gpu[name]["command"], "--device") == "cuda:0"
        assert "deploy" not in cpu[name] and _flag(cpu[name]["command"], "--device") == "cpu"
        same = [a for a in gpu[name]["command"] if a not in ("cuda:0", "cpu")]
        assert same == [a for a in cpu[name]["command"] if a not in ("cuda:0", "cpu")], name
    assert "deploy" not in gpu["gateway"] and "deploy" not in cpu["gateway"]


@pytest.mark.parametrize("files", [(MAIN,), (MAIN, CPU)], ids=["gpu", "cpu"])
def test_stage_commands_pass_the_stage_parsers(files):
    svc = load(*files)["services"]
    for name in (*STAGES, "gateway"):
        cmd = svc[name]["command"]
        assert cmd[:3] == ["python", "-m", f"services.{name}"]
        from easerve.stages.configs import STAGE_CONFIGS, from_argv
        cfg = from_argv(STAGE_CONFIGS[name], name, cmd[3:])  # SystemExit on a flag the stage does not know
        assert cfg.model == "/models"


def test_model_init_makes_the_tiny_checkpoint_only_when_none_is_mounted():
    init = load(MAIN)["services"]["model-init"]
    script = init["command"][-1]
    assert init["command"][:2] == ["sh", "-c"] and "[ -f /models/config.json ]" in script
    make = shlex.split(script[script.index("hasctl make-tiny"):].split(";")[0])
    from hasctl.cli import build_parser

    args = build_parser().parse_args(make[1:])
    assert args.command == "make-tiny" and args.out == "/models"


# ---- the healthcheck module ---------------------------------------------------------------------
@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_healthcheck_exit_code_follows_serving(health_server, capsys):
    servicer, addr = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("easerve.v1.Decode", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([addr]) == 0
    assert healthcheck.main([addr, "easerve.v1.Decode"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out
    assert healthcheck.main([addr, "easerve.v1.Nope"]) == 1
    assert "SERVICE_UNKNOWN" in capsys.readouterr().out
    assert healthcheck.main(["127.0.0.1:1", "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out
