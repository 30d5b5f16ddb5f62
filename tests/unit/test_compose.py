"""`hasctl compose` and the committed compose files: one service per worker instance running the
launcher's argv (hasctl.deployment.to_commands), health-gated start order, GPU reservations that
let CUDA IPC work between containers, shm shared between containers; and
`python -m easerve.healthcheck` reporting grpc health as an exit code."""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from easerve import healthcheck
from hasctl.cli import main as hasctl_main
from hasctl.compose import ComposeOptions, compose_dict
from hasctl.deployment import HEALTH_SERVICES, PRESETS, STAGES, Deployment, Worker, to_commands
from hasctl.launch import assign_ports

ROOT = Path(__file__).resolve().parents[2]
GPU_FILE, CPU_FILE = ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"
ADDED = ("--kv-transport", "--served-model-name", "--metrics-listen")  # flags compose sets when the deployment leaves them out


def _interpolate(value):
    """${VAR:-default} -> default (no environment read: the file's own defaults are checked)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _without(cmd, *names):
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
        elif a in names:
            skip = True
        else:
            out.append(a)
    return out


def gpus_2x3x3(devices=range(8)) -> Deployment:
    dev = [f"cuda:{i}" for i in devices]
    return Deployment(name="gpu-2x3x3", encode=(Worker(device=dev[0], flags={"colocate-prefill": True,
                                                                             "remote-fraction": 0.5}),
                                                 Worker(device=dev[1], flags={"max-batch": 16})),
                      prefill=tuple(Worker(device=d) for d in dev[2:5]),
                      decode=tuple(Worker(device=d, flags={"max-running": 96}) for d in dev[5:8]))


CASES = {**PRESETS, "gpu-2x3x3": gpus_2x3x3(), "text-only": Deployment(name="text-only")}


# ---- the committed files are what hasctl compose writes ------------------------------------------
@pytest.mark.parametrize("path,args", [(GPU_FILE, ["--device", "cuda:0"]), (CPU_FILE, ["--cpu"])], ids=["gpu", "cpu"])
def test_committed_files_are_generated(path, args, capsys):
    assert hasctl_main(["compose", "--preset", "default", *args, "--build-context", "."]) == 0
    assert capsys.readouterr().out == path.read_text(), \
        f"regenerate: hasctl compose --preset default {' '.join(args)} --build-context . > {path.name}"


def _has_docker_compose() -> bool:
    return bool(shutil.which("docker")) and subprocess.run(["docker", "compose", "version"],
                                                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="docker compose is not installed; the checks below still run")
@pytest.mark.parametrize("path", [GPU_FILE, CPU_FILE], ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(path):
    r = subprocess.run(["docker", "compose", "-f", str(path), "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


# ---- any deployment -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_services_run_the_launchers_argv(name):
    d = CASES[name]
    svc = _interpolate(compose_dict(d, ComposeOptions(base_port=41000))["services"])
    assert list(svc) == [f"{s}-{i}" for s in STAGES for i in range(len(getattr(d, s)))] + ["gateway"]
    ports = assign_ports(d, base_port=41000)
    gpus = sorted({int(w.device.partition(":")[2] or 0) for w in d.workers() if w.device.startswith("cuda")})
    in_container = dataclasses.replace(d, **{s: tuple(
        dataclasses.replace(w, device=f"cuda:{gpus.index(int(w.device[5:]))}") if w.device.startswith("cuda") else w
        for w in getattr(d, s)) for s in STAGES})
    for cmd in to_commands(in_container.with_model("/models"), "127.0.0.1", ports):
        got = svc[cmd.name]["command"]
        if cmd.name == "gateway":
            assert _flag(got, "--listen") == f"0.0.0.0:{ports['gateway']}"
            assert _flag(got, "--http-listen") == f"0.0.0.0:{ports['gateway-http']}"
            got = [a.replace("0.0.0.0:", "127.0.0.1:") for a in got]
        assert _without(got, *ADDED) == _without(list(cmd.argv), *ADDED), cmd.name
        test = svc[cmd.name]["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "easerve.healthcheck", f"127.0.0.1:{cmd.port}",
                        HEALTH_SERVICES[cmd.stage]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_health_gates_the_start_order(name):
    d = CASES[name]
    svc = compose_dict(d)["services"]
    names = {s: [f"{s}-{i}" for i in range(len(getattr(d, s)))] for s in STAGES}
    for n, s in svc.items():
        deps = s.get("depends_on", {})
        assert all(c == {"condition": "service_healthy"} for c in deps.values()), n
        stage = n.rpartition("-")[0] if n != "gateway" else "gateway"
        want = {"decode": [], "monolith": [], "prefill": names["decode"],
                "gateway": [x for s in STAGES for x in names[s]]}.get(stage)
        if stage == "encode":
            colocated = "--colocate-prefill" in s["command"]
            want = names["prefill"] + (names["decode"] if colocated else [])
        assert sorted(deps) == sorted(want), n


def test_gpu_services_share_one_gpu_numbering_pid_and_shm():
    d = gpus_2x3x3(devices=(3, 3, 5, 5, 6, 1, 1, 7))  # sparse and shared GPUs
    svc = _interpolate(compose_dict(d)["services"])
    union = ["1", "3", "5", "6", "7"]
    for stage in STAGES:
        for i, w in enumerate(getattr(d, stage)):
            s = svc[f"{stage}-{i}"]
            (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
            assert dev == {"driver": "nvidia", "device_ids": union, "capabilities": ["gpu"]}
            assert _flag(s["command"], "--device") == f"cuda:{union.index(w.device[5:])}"
            assert s["pid"] == s["ipc"] == s["network_mode"] == "host"
            assert "/dev/shm:/dev/shm" in s["volumes"] and s["environment"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "deploy" not in svc["gateway"] and "pid" not in svc["gateway"]


@pytest.mark.parametrize("prefill,decode,want", [("cuda:0", "cuda:1", "cuda_ipc"), ("cuda:0", "cpu", "shm"),
                                                 ("cpu", "cpu", "shm"), ("cpu", "cuda:0", "shm")])
def test_kv_senders_are_told_the_one_host_transport(prefill, decode, want):
    d = Deployment(encode=(Worker(device=prefill, flags={"colocate-prefill": True, "remote-fraction": 0.5}),
                           Worker(device=prefill)),
                   prefill=(Worker(device=prefill),), decode=(Worker(device=decode),))
    svc = compose_dict(d)["services"]
    assert _flag(svc["prefill-0"]["command"], "--kv-transport") == want
    assert _flag(svc["encode-0"]["command"], "--kv-transport") == want       # co-located prefill sends KV
    assert "--kv-transport" not in svc["encode-1"]["command"]                # only embeddings: nothing to set
    mine = d.with_flags("prefill", kv_transport="grpc")
    assert _flag(compose_dict(mine)["services"]["prefill-0"]["command"], "--kv-transport") == "grpc"


def test_cpu_option_drops_the_gpus_and_keeps_shm_shared():
    svc = compose_dict(gpus_2x3x3(), ComposeOptions(cpu=True))["services"]
    assert all("deploy" not in s and _flag(s["command"], "--device") in (None, "cpu") for s in svc.values())
    assert all(s["ipc"] == "host" and "/dev/shm:/dev/shm" in s["volumes"] for s in svc.values())


def test_model_folder_is_a_volume_and_the_tiny_one_needs_none():
    tiny = compose_dict(PRESETS["default"])
    assert tiny["volumes"] == {"models": {}}
    for s in tiny["services"].values():
        assert "${EASERVE_MODEL_DIR:-models}:/models" in s["volumes"] and _flag(s["command"], "--model") == "/models"
    assert _flag(tiny["services"]["gateway"]["command"], "--served-model-name") == "qwen2.5-vl-tiny-s0"
    mine = compose_dict(PRESETS["default"].with_model("/data/Qwen2.5-VL-7B"))
    assert "volumes" not in mine
    assert "${EASERVE_MODEL_DIR:-/data/Qwen2.5-VL-7B}:/models" in mine["services"]["decode-0"]["volumes"]
    assert _flag(mine["services"]["gateway"]["command"], "--served-model-name") == "Qwen2.5-VL-7B"


def test_a_hub_id_stays_in_every_command_with_one_hub_cache_volume():
    doc = compose_dict(PRESETS["colocated"].with_model("Org/Name@v1"))
    assert doc["volumes"] == {"hf-home": {}}
    for name, s in doc["services"].items():
        assert _flag(s["command"], "--model") == "Org/Name@v1", name  # each container fetches its own files
        assert "${EASERVE_HF_HOME:-hf-home}:/hf-home" in s["volumes"]
        assert not any(v.endswith(":/models") for v in s["volumes"])
        assert {k: s["environment"][k] for k in ("HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE")} == \
            {"HF_HOME": "/hf-home", "HF_TOKEN": "${HF_TOKEN:-}", "HF_HUB_OFFLINE": "${HF_HUB_OFFLINE:-0}"}
    assert _flag(doc["services"]["gateway"]["command"], "--served-model-name") == "Org/Name"


def test_ports_move_with_environment_variables():
    svc = compose_dict(PRESETS["default"])["services"]
    assert _flag(svc["prefill-0"]["command"], "--decode") == "127.0.0.1:${EASERVE_PORT_DECODE_0:-50052}"
    assert _flag(svc["gateway"]["command"], "--http-listen") == "0.0.0.0:${EASERVE_HTTP_PORT:-8000}"
    assert svc["gateway"]["image"] == "${EASERVE_IMAGE:-easerve:latest}"


@pytest.mark.parametrize("files", [GPU_FILE, CPU_FILE], ids=["gpu", "cpu"])
def test_stage_commands_pass_the_stage_parsers(files):
    svc = _interpolate(yaml.safe_load(files.read_text())["services"])
    for name, s in svc.items():
        stage = name.rpartition("-")[0] if name != "gateway" else "gateway"
        cmd = s["command"]
        assert cmd[:3] == ["python", "-m", f"services.{stage}"]
        from easerve.stages.common.configs import STAGE_CONFIGS
        from easerve.stages.common.argv import from_argv
        cfg = from_argv(STAGE_CONFIGS[stage], stage, cmd[3:])  # SystemExit on a flag the stage does not know
        assert cfg.model == "/models"


def test_cli_writes_a_file_and_rejects_bad_options(tmp_path, capsys):
    f = gpus_2x3x3().dump(tmp_path / "best.yaml")
    out = tmp_path / "best.compose.yml"
    assert hasctl_main(["compose", "--deployment", str(f), "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert len(doc["services"]) == 9 and out.read_text().startswith("# EAServe deployment 'gpu-2x3x3'")
    with pytest.raises(ValueError, match="base_port"):
        ComposeOptions(base_port=80)
    assert hasctl_main(["compose", "--deployment", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the deployment file" in capsys.readouterr().err


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_service_serves_metrics_where_its_scrape_labels_and_config_say(name):
    doc = _interpolate(compose_dict(CASES[name], ComposeOptions(base_port=41000)))
    targets = {c["labels"]["process"]: c["targets"] for c in doc["x-prometheus"]["scrape_configs"][0]["static_configs"]}
    assert set(targets) == set(doc["services"])
    for proc, svc in doc["services"].items():
        labels, cmd = svc["labels"], svc["command"]
        assert labels["prometheus.io/scrape"] == "true" and labels["prometheus.io/path"] == "/metrics"
        listen = _flag(cmd, "--metrics-listen") or _flag(cmd, "--http-listen")  # the gateway: its HTTP port
        port = listen.rpartition(":")[2]
        assert labels["prometheus.io/port"] == port and targets[proc] == [f"127.0.0.1:{port}"]
        if proc != "gateway":
            assert listen.startswith("127.0.0.1:")
    ports = [int(s["labels"]["prometheus.io/port"]) for s in doc["services"].values()]
    assert len(set(ports)) == len(ports)


def test_stop_grace_covers_the_whole_drain():
    """`docker compose stop` SIGKILLs only after a stage's drain could end: its bound
    (--drain-timeout-s, default 600 s) plus --grace-s (default 10 s), and a margin."""
    d = Deployment(name="drains", prefill=(Worker(flags={"drain-timeout-s": 120, "grace-s": 2}),))
    services = compose_dict(d)["services"]
    assert services["prefill-0"]["stop_grace_period"] == "127s"
    assert services["decode-0"]["stop_grace_period"] == services["gateway"]["stop_grace_period"] == "615s"
