"""`hasctl compose`: a docker compose file for a deployment on one host (docker or podman).

    hasctl compose --deployment best.yaml > best.compose.yml && docker compose -f best.compose.yml up
    hasctl compose --preset default --cpu --build-context . > docker-compose.cpu.yml

One service per worker instance (`decode-0`, `prefill-0`, ..., `gateway`), each running exactly
the argv `hasctl.deployment.to_commands` gives the launcher (`hasctl up`). The file stands alone
(not an override of docker-compose.yml: an override cannot remove the base's services when the
deployment has other instance counts or no encode stage).

One host, so:
- every service uses host networking: stages bind 127.0.0.1 (reachable only on this host), the
  gateway binds `bind` (0.0.0.0); ports can be moved with EASERVE_GRPC_PORT, EASERVE_HTTP_PORT
  and EASERVE_PORT_<PROCESS> (e.g. EASERVE_PORT_DECODE_0);
- all services share the host's /dev/shm (`ipc: host`, and a bind mount of /dev/shm for engines
  that ignore `ipc`, as podman-compose 1.6 does) and, with GPUs, its PID namespace and
  one GPU numbering: each GPU service reserves every GPU the deployment uses (sorted, in PCI
  order) and runs on its own one by index, since CUDA IPC handles name a device by index and
  the receiver must see the sender's GPU;
- the KV senders (prefill, encode with co-located prefill) are told the transport instead of
  guessing it from addresses: cuda_ipc when the sender and every decode worker are on GPUs,
  else shm (a deployment's own kv-transport flag wins);
- health checks (grpc.health.v1 through easerve.healthcheck) gate the start order: prefill
  waits for decode, encode for prefill (and decode when it co-locates prefill), the gateway
  for all.
The model: the deployment's folder bind-mounted at /models (read-only), or, with no model, the
tiny checkpoint the image carries at /models, through a named volume (EASERVE_MODEL_DIR=/path
replaces either). A hub id (ORG/NAME[@REVISION]) stays in every command: each container fetches
the files its stage loads into one hub cache, the named volume `hf-home` at /hf-home (HF_HOME;
EASERVE_HF_HOME=/path mounts a host folder instead), with the caller's HF_TOKEN and HF_HUB_OFFLINE.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from easerve.models.hub import parse_hub_id
from hasctl.deployment import STAGES, Command, Deployment, Worker, preset, stop_s, to_commands
from hasctl.tensor_parallel import check_launchable

MODEL_DIR = "/models"          # where every container sees the checkpoint
HF_HOME_DIR = "/hf-home"       # HF_HOME in every container of a hub-id deployment
HF_HOME_VOLUME = "hf-home"     # its named volume (EASERVE_HF_HOME=/path: a host folder)
TINY_MODEL_NAME = "qwen2.5-vl-tiny-s0"  # served name of the image's tiny model (as `hasctl up` names it)
_ADDR_FLAGS = ("--listen", "--http-listen", "--decode", "--prefill", "--encode", "--metrics-listen")
METRICS_PORT_OFFSET = 1000     # a stage's /metrics port: its gRPC port + this (EASERVE_METRICS_PORT_<PROCESS>)
_CPU_SET = re.compile(r"^cpu:([\d,\-]+)$")


@dataclass(frozen=True)
class ComposeOptions:
    image: str = "easerve:latest"
    cpu: bool = False                  # every stage on the CPU, no GPU reservations
    device: str | None = None          # every stage on this device (cpu, cuda:0, ...)
    bind: str = "0.0.0.0"              # address the gateway binds; stages bind 127.0.0.1
    base_port: int = 50052             # first port for workers whose port is 0
    build_context: str | None = None   # add `build:` (this folder holds docker/Dockerfile)
    project: str = "easerve"

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("image must name the EAServe image, e.g. easerve:latest")
        if not 1024 <= self.base_port <= 65000:
            raise ValueError(f"base_port must be in 1024..65000, got {self.base_port}")
        if not re.match(r"^[a-z0-9][a-z0-9_-]*$", self.project):
            raise ValueError(f"project must be lowercase letters, digits, '-' or '_', got {self.project!r}")


# ---- helpers shared with hasctl.k8s -------------------------------------------------------------
def is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def gpu_index(device: str) -> int:
    """cuda -> 0, cuda:N -> N."""
    return int(device.partition(":")[2] or 0)


def cpu_cores(device: str) -> str | None:
    """The core list of a `cpu:0-3` style device ("0-3"), None for plain cpu."""
    m = _CPU_SET.match(device)
    return m.group(1) if m else None


def core_count(cores: str) -> int:
    n = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def sends_kv(stage: str, w: Worker) -> bool:
    return stage == "prefill" or (stage == "encode" and bool(w.flag("colocate-prefill")))


def map_workers(d: Deployment, fn) -> Deployment:
    """A copy of `d` with every worker replaced by fn(stage, worker)."""
    return dataclasses.replace(d, **{s: tuple(fn(s, w) for w in getattr(d, s)) for s in STAGES})


def flag_value(argv: tuple[str, ...] | list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def replace_flag(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


# ---- the compose file ---------------------------------------------------------------------------
def _one_host(d: Deployment, device: str | None) -> tuple[Deployment, list[int]]:
    """Devices as the containers see them (GPU k of the sorted union), and that union; KV
    senders told their transport."""
    if device:
        d = d.with_device(device)
    gpus = sorted({gpu_index(w.device) for w in d.workers() if is_gpu(w.device)})
    all_gpu_decode = all(is_gpu(w.device) for w in d.decode)

    def fix(stage: str, w: Worker) -> Worker:
        if is_gpu(w.device):
            w = dataclasses.replace(w, device=f"cuda:{gpus.index(gpu_index(w.device))}")
        if sends_kv(stage, w) and w.flag("kv-transport") is None:
            kind = "cuda_ipc" if is_gpu(w.device) and all_gpu_decode else "shm"
            w = dataclasses.replace(w, flags={**dict(w.flags), "kv-transport": kind})
        return w
    return map_workers(d, fix), gpus


def _ports(d: Deployment, base_port: int) -> dict[str, int]:
    from hasctl.launch import assign_ports  # the launcher's port assignment, with a base port
    return assign_ports(d, base_port=base_port)


def metrics_ports(cmds: list[Command]) -> dict[str, int]:
    """process -> its /metrics port: the gateway's HTTP port, a stage's gRPC port + METRICS_PORT_OFFSET."""
    http = {c.name: int(flag_value(c.argv, "--http-listen").rpartition(":")[2]) for c in cmds if c.stage == "gateway"}
    return {c.name: http.get(c.name) or c.port + METRICS_PORT_OFFSET for c in cmds}


def with_metrics(cmd: Command, host: str, port: int) -> Command:
    """A stage's argv serving /metrics on host:port (the gateway serves it on its HTTP port already)."""
    if cmd.stage == "gateway" or "--metrics-listen" in cmd.argv:
        return cmd
    return dataclasses.replace(cmd, argv=(*cmd.argv, "--metrics-listen", f"{host}:{port}"))


def scrape_labels(port: int) -> dict[str, str]:
    """The prometheus.io/* annotations (k8s) and labels (compose) Prometheus discovery reads."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def port_var(name: str) -> str:
    return {"gateway": "EASERVE_GRPC_PORT", "gateway-http": "EASERVE_HTTP_PORT"}.get(
        name, "EASERVE_PORT_" + name.upper().replace("-", "_"))


def _interpolated(argv: tuple[str, ...], port_vars: dict[int, str]) -> list[str]:
    """argv for compose: `$` escaped, and the ports in address flags as ${VAR:-port}."""
    out = [a.replace("$", "$$") for a in argv]
    for i in range(1, len(out)):
        if argv[i - 1] in _ADDR_FLAGS:
            out[i] = ",".join(_addr_var(a, port_vars) for a in out[i].split(","))
    return out


def _addr_var(addr: str, port_vars: dict[int, str]) -> str:
    host, _, port = addr.rpartition(":")
    var = port_vars.get(int(port))
    return f"{host}:${{{var}:-{port}}}" if var else addr


def _health(cmd: Command, port_vars: dict[int, str]) -> dict:
    return {"test": ["CMD", "python", "-m", "easerve.healthcheck",
                     f"127.0.0.1:${{{port_vars[cmd.port]}:-{cmd.port}}}", cmd.health_service],
            "interval": "5s", "timeout": "5s", "retries": 3, "start_period": "600s"}


def _depends(stage: str, w: Worker | None, names: dict[str, list[str]]) -> list[str]:
    if stage == "gateway":
        return [n for s in STAGES for n in names[s]]
    deps = {"decode": [], "monolith": [], "prefill": ["decode"], "encode": ["prefill"]}[stage]
    if w is not None and stage == "encode" and w.flag("colocate-prefill"):
        deps = ["decode", "prefill"]
    return [n for s in deps for n in names[s]]


def compose_dict(d: Deployment, opts: ComposeOptions = ComposeOptions()) -> dict:
    """The compose file (as a mapping) that runs `d` on one host."""
    check_launchable(d)  # before GPUs are renumbered
    d, gpus = _one_host(d, "cpu" if opts.cpu else opts.device)
    hub = parse_hub_id(d.model) is not None
    model_src = "" if hub else _model_source(d.model)
    if not dict(d.gateway.flags).get("served-model-name"):
        d = d.with_flags("gateway", served_model_name=served_name(d.model))
    d = d if hub else d.with_model(MODEL_DIR)
    ports = _ports(d, opts.base_port)
    port_vars = {p: port_var(n) for n, p in ports.items()}
    cmds = to_commands(d, "127.0.0.1", ports)
    mports = metrics_ports(cmds)
    cmds = [with_metrics(c, "127.0.0.1", mports[c.name]) for c in cmds]
    port_vars.update({mports[c.name]: "EASERVE_METRICS_PORT_" + c.name.upper().replace("-", "_")
                      for c in cmds if c.stage != "gateway"})
    workers = {f"{s}-{i}": (s, w) for s in STAGES for i, w in enumerate(getattr(d, s))}
    names = {s: [c.name for c in cmds if c.stage == s] for s in STAGES}
    services = {}
    for cmd in cmds:
        stage, w = workers.get(cmd.name, ("gateway", None))
        svc = _service(cmd, w, opts, model_src, port_vars, stop_s(w.flags if w else d.gateway.flags))
        deps = _depends(stage, w, names)
        if deps:
            svc["depends_on"] = {n: {"condition": "service_healthy"} for n in deps}
        if w is not None and is_gpu(w.device):
            svc["pid"] = "host"
            svc["environment"]["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            svc["deploy"] = {"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "device_ids": [str(g) for g in gpus], "capabilities": ["gpu"]}]}}}
        elif w is not None and cpu_cores(w.device):
            svc["cpuset"] = cpu_cores(w.device)
        svc["labels"] = scrape_labels(mports[cmd.name])
        services[cmd.name] = svc
    doc: dict[str, Any] = {"name": opts.project, "services": services, "x-prometheus": _scrape_config(mports)}
    if hub:
        doc["volumes"] = {HF_HOME_VOLUME: {}}
    elif not model_src.startswith(("/", ".")):
        doc["volumes"] = {model_src: {}}
    return doc


def _service(cmd: Command, w: Worker | None, opts: ComposeOptions, model_src: str, port_vars: dict[int, str],
             stop: float) -> dict[str, Any]:
    """What every service has: image, host network and /dev/shm, the model, argv, health, and
    the time `docker compose stop` gives it (`stop`: its drain, see `stop_s`)."""
    argv = list(cmd.argv)
    if w is None:  # the gateway: the one public listener
        for flag in ("--listen", "--http-listen"):
            argv = replace_flag(argv, flag, opts.bind + ":" + flag_value(argv, flag).rpartition(":")[2])
    svc: dict[str, Any] = {"image": f"${{EASERVE_IMAGE:-{opts.image}}}"}
    if opts.build_context is not None:
        svc["build"] = {"context": opts.build_context, "dockerfile": "docker/Dockerfile"}
    model = f"${{EASERVE_MODEL_DIR:-{model_src}}}:{MODEL_DIR}" if model_src else \
        f"${{EASERVE_HF_HOME:-{HF_HOME_VOLUME}}}:{HF_HOME_DIR}"
    hub_env = {} if model_src else {"HF_HOME": HF_HOME_DIR, "HF_TOKEN": "${HF_TOKEN:-}",
                                    "HF_HUB_OFFLINE": "${HF_HUB_OFFLINE:-0}"}
    svc.update({
        "network_mode": "host", "ipc": "host",
        "volumes": [model, "/dev/shm:/dev/shm"],
        "environment": {"EASERVE_LOG_LEVEL": "${EASERVE_LOG_LEVEL:-INFO}", **hub_env,
                        **{k: f"${{{k}:-{v}}}" for k, v in cmd.env}},  # the caller's value wins
        "command": _interpolated(tuple(argv), port_vars),
        "healthcheck": _health(cmd, port_vars),
        "restart": "unless-stopped",
        "stop_grace_period": f"{math.ceil(stop) + 5}s",   # SIGKILL only after the stage's drain
    })
    return svc


def _scrape_config(mports: dict[str, int]) -> dict:
    """A Prometheus `scrape_configs` entry for every process (host networking: all on 127.0.0.1;
    the default ports, regenerate the file after moving them)."""
    return {"scrape_configs": [{"job_name": "easerve", "metrics_path": "/metrics", "static_configs": [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"process": name, "stage": name.rpartition("-")[0] or name}}
        for name, port in mports.items()]}]}


def _model_source(model: str) -> str:
    """What is mounted at /models: the deployment's folder, or the named volume `models`
    (docker and podman fill an empty named volume with the image's /models: the tiny model)."""
    if not model:
        return "models"
    if "$" in model:
        raise ValueError(f"model {model!r}: a folder path without '$'")
    return model if model.startswith(("/", ".")) else f"./{model}"


def served_name(model: str) -> str:
    """The model id the gateway serves: a hub id's ORG/NAME, the folder's name, or the tiny model's."""
    if not model:
        return TINY_MODEL_NAME
    ref = parse_hub_id(model)
    return ref.repo_id if ref else model.rstrip("/").rpartition("/")[2]


def dump(doc: dict) -> str:
    """YAML with short lists on one line (commands read as they would be typed), multi-line
    strings as blocks, and no anchors."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)
    Dumper.add_representer(str, text)
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=120, default_flow_style=None)


def header(d: Deployment, opts: ComposeOptions, argv: list[str]) -> str:
    d, _ = _one_host(d, "cpu" if opts.cpu else opts.device)
    gpu = any(is_gpu(w.device) for w in d.workers())
    return "\n".join([
        f"# EAServe deployment {d.name!r} on one host, written by `hasctl {' '.join(argv)}`.",
        "# Regenerate instead of editing (tests/unit/test_compose.py checks the committed files).",
        "#   docker compose -f THIS_FILE up [--build]      (podman-compose -f THIS_FILE up works too)",
        "# Host networking: the gateway serves gRPC on :${EASERVE_GRPC_PORT:-%d} and OpenAI HTTP on"
        % d.gateway.grpc_port,
        "# :${EASERVE_HTTP_PORT:-%d}; stages listen on 127.0.0.1 only. Your checkpoint: EASERVE_MODEL_DIR=/path;"
        % d.gateway.http_port,
        "# the image: EASERVE_IMAGE. Start order, shared memory and GPU numbering: docs/deploy.md.",
        ("# GPUs: NVIDIA driver >= 580 (CUDA 13) and the NVIDIA container toolkit; see docs/deploy.md."
         if gpu else "# CPU only: no GPU reservations."),
        ""])


def add_parser(sub) -> None:
    p = sub.add_parser("compose", help="write a docker compose file that runs a deployment on one host")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--deployment", default=None, help="a deployment file (.json / .yaml), e.g. from hasctl tune")
    src.add_argument("--preset", default=None, help="a named deployment (default: default)")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--cpu", action="store_true", help="every stage on the CPU, no GPU reservations")
    dev.add_argument("--device", default=None, help="every stage on this device (e.g. cuda:0)")
    p.add_argument("--image", default=ComposeOptions.image, help="the EAServe image (default: easerve:latest)")
    p.add_argument("--bind", default=ComposeOptions.bind, help="address the gateway binds (default: 0.0.0.0)")
    p.add_argument("--base-port", type=int, default=ComposeOptions.base_port,
                   help="first port for stage workers whose port is 0 (default: 50052)")
    p.add_argument("--build-context", default=None, help="add a build section with this context (the repo)")
    p.add_argument("--out", default=None, help="write here instead of stdout")
    p.set_defaults(func=run)


def load_deployment(args) -> Deployment:
    return Deployment.load(args.deployment) if args.deployment else preset(args.preset or "default")


def run(args) -> int:
    d = load_deployment(args)
    opts = ComposeOptions(image=args.image, cpu=args.cpu, device=args.device, bind=args.bind, base_port=args.base_port,
                          build_context=args.build_context)
    text = header(d, opts, _argv(args)) + dump(compose_dict(d, opts))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _argv(args) -> list[str]:
    out = ["compose"]
    out += ["--deployment", args.deployment] if args.deployment else ["--preset", args.preset or "default"]
    if args.cpu:
        out.append("--cpu")
    for flag, default in (("device", None), ("image", ComposeOptions.image), ("bind", ComposeOptions.bind),
                          ("base_port", ComposeOptions.base_port), ("build_context", None)):
        value = getattr(args, flag)
        if value != default:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out
