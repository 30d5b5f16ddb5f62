"""A deployment: which stage processes run, on which devices and ports, with which knobs.

The file (JSON or YAML, what `hasctl tune` writes and `hasctl up` / docker compose consume):

    name: default
    model: ""                 # checkpoint folder or hub id ORG/NAME[@REVISION]; "" = the default tiny checkpoint
    served_model_name: ""     # the model id clients send and /v1/models lists; "" = the hub id or folder name
    gateway: {grpc_port: 50051, http_port: 8000, flags: {}}
    encode:  [{device: cpu, port: 0, flags: {max-batch: 8, remote-fraction: 1.0, batch-mode: adaptive}}]
    prefill: [{device: cpu}]
    decode:  [{device: cpu, flags: {max-running: 64}}]     # {device: cuda:2, tp: 2}: one instance on 2 GPUs
    monolith: []              # encode + prefill + decode in one process (the aggregated baseline)

A device is `cpu`, `cpu:0-1` (pinned to those cores: on a CPU host cores are the devices),
`cuda` or `cuda:N`. Every stage may list several instances. A port of 0 is assigned at launch (from --base-port, else a free one). `flags` are the stage's
own command-line flags without the dashes' prefix; a flag set to true is passed bare, false is left out.
`tp` (default 1): the GPUs one instance spans (tensor parallel; rules in hasctl/tensor_parallel.py).
Addresses of peers (--prefill, --decode, --encode) are wired by `to_commands`, never set by hand.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from easerve.fields import check_device, cpu_cores
from easerve.stages.common.configs import STAGE_CONFIGS

from easerve.stages.common.argv import flag_kind, tunable_flags, to_argv
from hasctl.tensor_parallel import check_groups, check_launchable, check_tp

STAGES = ("decode", "prefill", "encode", "monolith")  # launch order; the gateway starts last
# what each stage's config accepts besides the flags the launcher wires itself
FLAGS = {s: tunable_flags(s) for s in (*STAGES, "gateway")}
Flags = tuple[tuple[str, Any], ...]


def _norm_flags(flags: Any, where: str, stage: str) -> Flags:
    items = flags.items() if isinstance(flags, Mapping) else flags
    try:
        pairs = tuple(sorted((str(k).removeprefix("--").replace("_", "-"), v) for k, v in items))
    except (TypeError, ValueError):
        raise ValueError(f"{where}.flags must be a mapping of flag name to value, got {flags!r}") from None
    for k, v in pairs:
        if k not in FLAGS[stage]:
            raise ValueError(f"{where}.flags: unknown flag {k!r} for the {stage} stage; "
                             f"allowed: {', '.join(FLAGS[stage])} (peer addresses are wired by hasctl)")
        if not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"{where}.flags.{k} must be a string, number or boolean, got {v!r}")
    return pairs


def _check_port(port: Any, where: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{where} must be an int in 0..65535 (0 = assign at launch), got {port!r}")


@dataclass(frozen=True)
class Worker:
    """One stage process."""
    device: str = "cpu"
    port: int = 0
    flags: Flags | Mapping[str, Any] = ()
    tp: int = 1      # GPUs the instance spans: cuda:N .. cuda:N+tp-1

    def check(self, stage: str, where: str) -> Worker:
        try:
            check_device(self.device)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
        _check_port(self.port, f"{where}.port")
        check_tp(self.tp, self.device, where)
        return dataclasses.replace(self, flags=_norm_flags(self.flags, where, stage))

    def flag(self, name: str, default: Any = None) -> Any:
        return dict(self.flags).get(name, default)


@dataclass(frozen=True)
class GatewaySpec:
    grpc_port: int = 50051
    http_port: int = 8000
    flags: Flags | Mapping[str, Any] = ()


def _worker(w: Any, stage: str, i: int) -> Worker:
    if not isinstance(w, Worker):
        raise ValueError(f"{stage}[{i}] must be a Worker(device, port, flags), got {type(w).__name__}")
    return w.check(stage, f"{stage}[{i}]")


@dataclass(frozen=True)
class Deployment:
    model: str = ""
    encode: tuple[Worker, ...] = ()
    prefill: tuple[Worker, ...] = (Worker(),)
    decode: tuple[Worker, ...] = (Worker(),)
    monolith: tuple[Worker, ...] = ()
    gateway: GatewaySpec = GatewaySpec()
    name: str = "custom"
    served_model_name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ValueError(f"model must be a checkpoint path, a hub id or '' (the default tiny one), got {self.model!r}")
        if not isinstance(self.served_model_name, str):
            raise ValueError(f"served_model_name must be a string ('' = the model folder's name), "
                             f"got {self.served_model_name!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for stage in STAGES:  # normalized once, while constructing
            object.__setattr__(self, stage, tuple(_worker(w, stage, i) for i, w in enumerate(getattr(self, stage))))
        gw = self.gateway
        _check_port(gw.grpc_port, "gateway.grpc_port")
        _check_port(gw.http_port, "gateway.http_port")
        object.__setattr__(self, "gateway", dataclasses.replace(gw, flags=_norm_flags(gw.flags, "gateway", "gateway")))
        if not self.monolith and (not self.decode or not self.prefill):
            raise ValueError("a deployment needs at least one decode and one prefill worker "
                             "(the gateway sends text-only requests to prefill), or a monolith")
        self._check_flags()
        check_groups((f"{s}[{i}]", w.device, w.tp) for s in STAGES for i, w in enumerate(getattr(self, s)))
        ports = [w.port for w in self.workers()] + [gw.grpc_port, gw.http_port]
        dup = sorted({p for p in ports if p and ports.count(p) > 1})
        if dup:
            raise ValueError(f"ports {dup} are used by more than one process; give each its own or 0")

    def _check_flags(self) -> None:
        """Each worker's flags, checked by its stage's own config (as its process will)."""
        self._stage_configs()

    def _stage_configs(self) -> list:
        dummy = {s: ("127.0.0.1:1",) if getattr(self, s) else () for s in ("prefill", "decode")}
        wiring = {"decode": {}, "prefill": {"decode": dummy["decode"]}, "monolith": {},
                  "encode": {"prefill": dummy["prefill"], "decode": dummy["decode"]}}
        return [stage_config(stage, {"model": self.model or "model", "device": w.device, **wiring[stage]},
                              w.flags, f"{stage}[{i}]")
                for stage in STAGES for i, w in enumerate(getattr(self, stage))]

    def model_roles(self) -> tuple[str, ...]:
        """The adapter roles this deployment's processes load (the gateway's 'processor' too)."""
        return tuple(sorted({"processor", *(r for c in self._stage_configs() for r in c.model_roles)}))

    def fetch_model(self) -> str:
        """The model's folder, a hub id fetched (once, with the progress bar, before the processes
        start: each then finds its files in the cache) with the files its processes load."""
        from easerve.models.hub import resolve_model
        return str(resolve_model(self.model, self.model_roles()))

    def workers(self) -> list[Worker]:
        return [w for stage in STAGES for w in getattr(self, stage)]

    # ---- derived copies -----------------------------------------------------------------------
    def with_model(self, model: str) -> Deployment:
        return dataclasses.replace(self, model=str(model))

    def with_device(self, device: str) -> Deployment:
        """Every stage worker on `device` (e.g. cpu for a machine without GPUs)."""
        return dataclasses.replace(self, **{s: tuple(dataclasses.replace(w, device=device)
                                                     for w in getattr(self, s)) for s in STAGES})

    def with_flags(self, stage: str, **flags: Any) -> Deployment:
        """Set flags (python names: max_batch=4) on every worker of `stage` ("gateway" too)."""
        if stage == "gateway":
            g = self.gateway
            return dataclasses.replace(self, gateway=dataclasses.replace(g, flags={**dict(g.flags), **_dashed(flags)}))
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES + ('gateway',)}, got {stage!r}")
        new = tuple(dataclasses.replace(w, flags={**dict(w.flags), **_dashed(flags)}) for w in getattr(self, stage))
        return dataclasses.replace(self, **{stage: new})

    def with_gateway_ports(self, grpc_port: int, http_port: int) -> Deployment:
        return dataclasses.replace(self, gateway=dataclasses.replace(self.gateway, grpc_port=grpc_port,
                                                                     http_port=http_port))

    # ---- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def worker(w: Worker) -> dict:
            return {"device": w.device, "port": w.port, "flags": dict(w.flags), **({"tp": w.tp} if w.tp != 1 else {})}
        g = self.gateway
        return {"name": self.name, "model": self.model, "served_model_name": self.served_model_name,
                "gateway": {"grpc_port": g.grpc_port, "http_port": g.http_port, "flags": dict(g.flags)},
                **{s: [worker(w) for w in getattr(self, s)] for s in ("encode", "prefill", "decode", "monolith")}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "deployment") -> Deployment:
        data = _mapping(data, where, {"name", "model", "served_model_name", "gateway", *STAGES})
        kw: dict[str, Any] = {k: data[k] for k in ("name", "model", "served_model_name") if k in data}
        if "gateway" in data:
            kw["gateway"] = GatewaySpec(**_mapping(data["gateway"], "gateway", {"grpc_port", "http_port", "flags"}))
        for stage in STAGES:
            if stage in data:
                items = data[stage] or []
                if not isinstance(items, list):
                    raise ValueError(f"{stage} must be a list of workers ({{device, port, flags, tp}}), got {items!r}")
                kw[stage] = tuple(Worker(**_mapping(w, f"{stage}[{i}]", {"device", "port", "flags", "tp"}))
                                  for i, w in enumerate(items))
        return cls(**kw)

    def dumps(self, fmt: str = "json") -> str:
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=2) + "\n"
        if fmt == "yaml":
            import yaml
            return yaml.safe_dump(self.to_dict(), sort_keys=False)
        raise ValueError(f"format must be 'json' or 'yaml', got {fmt!r}")

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.dumps(_fmt(path)))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Deployment:
        """A file that does not parse says so; one that breaks a rule names the key to change."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the deployment file {str(path)!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        data = _parse(text, _fmt(path), path)
        try:
            return cls.from_dict(data, where="top level")
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _dashed(flags: Mapping[str, Any]) -> dict:
    return {k.replace("_", "-"): v for k, v in flags.items()}


def _fmt(path: Path) -> str:
    return "yaml" if path.suffix.lower() in (".yaml", ".yml") else "json"


def _parse(text: str, fmt: str, path: Path) -> Any:
    if fmt == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                             "fix it or use a .yaml file") from None
    import yaml
    try:
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as e:  # a syntax error (MarkedYAMLError: where) or unreadable characters
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ValueError(f"{path} is not valid YAML ({at}{problem or e}); fix it") from None


@functools.cache
def _loader():
    """yaml's SafeLoader without implicit dates: 2024-13-45 stays a string, checked as any value."""
    import yaml
    no_dates = {c: [(t, rx) for t, rx in rs if t != "tag:yaml.org,2002:timestamp"]
                for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    return type("Loader", (yaml.SafeLoader,), {"yaml_implicit_resolvers": no_dates})


def _mapping(data: Any, where: str, allowed: set[str]) -> dict:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping with keys {sorted(allowed)}, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return dict(data)


# ---- processes -------------------------------------------------------------------------------
HEALTH_SERVICES = {"decode": "easerve.v1.Decode", "prefill": "easerve.v1.Prefill", "encode": "easerve.v1.Encode",
                   "monolith": "easerve.v1.Decode", "gateway": "easerve.v1.Gateway"}


@dataclass(frozen=True)
class Command:
    """One process of a deployment: `argv` to run, the gRPC port its health is served on."""
    name: str        # "decode-0", ..., "gateway"
    stage: str
    argv: tuple[str, ...]
    port: int
    health_service: str
    env: tuple[tuple[str, str], ...] = ()  # defaults for its environment (the caller's own win)


def _stage_flag(flags, name: str) -> float:
    """A stage's numeric flag from its flags (the stage parser's default otherwise)."""
    from easerve.stages.common.configs import GatewayConfig
    value = dict(flags).get(name.replace("_", "-"))
    return float(GatewayConfig.__dataclass_fields__[name].default if value is None else value)


def stop_s(flags) -> float:
    """The longest a stage takes to exit after SIGTERM: its drain's bound (--drain-timeout-s:
    the calls it accepted finish, each by its own deadline) plus --grace-s after it."""
    return _stage_flag(flags, "drain_timeout_s") + _stage_flag(flags, "grace_s")


def command_stop_s(cmd: Command) -> float:
    """`stop_s` of a process from its argv."""
    argv = cmd.argv
    return stop_s({a[2:]: v for a, v in zip(argv, argv[1:]) if a in ("--drain-timeout-s", "--grace-s")})


def notice_s(d: Deployment) -> float:
    """How long the callers of an instance take to stop sending to it once it left the DNS
    records or the peers file: they look them up every --peer-refresh-s, then one poll."""
    flags = [d.gateway.flags, *(w.flags for s in STAGES for w in getattr(d, s))]
    return max(_stage_flag(f, "peer_refresh_s") for f in flags) + 1.0


def process_names(d: Deployment) -> list[str]:
    """Keys of the `ports` mapping `to_commands` takes, in launch order (+ "gateway-http")."""
    return [f"{s}-{i}" for s in STAGES for i in range(len(getattr(d, s)))] + ["gateway", "gateway-http"]


def stage_config(stage: str, fields: dict[str, Any], flags: Flags, where: str):
    """The stage's frozen config from wired fields + the deployment's flags (validated
    exactly as the stage process will validate its command line)."""
    kw = dict(fields)
    for k, v in flags:
        kind = flag_kind(stage, k)
        try:
            kw[k.replace("-", "_")] = tuple(str(v).split(",")) if kind is tuple else kind(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}.flags.{k} must be {_KINDS.get(kind, kind.__name__)}, got {v!r}") from None
    try:
        return STAGE_CONFIGS[stage](**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

# who calls whom: a stage's peer flag -> the stages whose instances that flag lists
PEER_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "decode": {}, "monolith": {}, "prefill": {"decode": ("decode",)}, "encode": {"prefill": ("prefill",)},
    # the gateway reaches a monolith as every stage
    "gateway": {"encode": ("encode", "monolith"), "prefill": ("prefill", "monolith"),
                "decode": ("decode", "monolith")},
}


def peer_roles(stage: str, colocated: bool = False) -> dict[str, tuple[str, ...]]:
    """The peer flags of a `stage` process and the stages each lists (an encode worker that
    co-locates prefill also hands KV to decode)."""
    roles = dict(PEER_ROLES[stage])
    if stage == "encode" and colocated:
        roles["decode"] = ("decode",)
    return roles


def peer_lists(roles: Mapping[str, tuple[str, ...]], addrs: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """flag -> addresses, from each stage's instance addresses."""
    return {flag: tuple(a for s in stages for a in addrs.get(s, ())) for flag, stages in roles.items()}


# A worker whose CPU cores another worker also uses gets these defaults: OpenMP threads that
# spin at a barrier (libgomp's default while it has a core per thread) burn the cores the other
# process needs; passive ones sleep. On bench/pipeline.py at 4 req/s (every stage on both of 2
# cores) this cut the stack's TTFT p50 by 0-45 % across seeds.
SHARED_CORES_ENV = (("OMP_WAIT_POLICY", "PASSIVE"),)


def _cpu_set(device: str) -> frozenset[int] | str | None:
    """A worker's CPU cores: a set, "all" for plain `cpu`, None for a GPU."""
    if device == "cpu":
        return "all"
    cores = cpu_cores(device)
    return None if cores is None else frozenset(cores)


def shares_cores(d: Deployment, stage: str, index: int) -> bool:
    """Whether that worker runs on CPU cores another E / P / D / monolith worker also uses."""
    mine = _cpu_set(getattr(d, stage)[index].device)
    if mine is None:
        return False
    for other in STAGES:
        for j, w in enumerate(getattr(d, other)):
            theirs = _cpu_set(w.device)
            if (other, j) != (stage, index) and theirs is not None and \
                    ("all" in (mine, theirs) or mine & theirs):
                return True
    return False


def stage_command(d: Deployment, stage: str, w: Worker, name: str, host: str, port: int,
                  addrs: Mapping[str, Sequence[str]], python: str = "python",
                  env: tuple[tuple[str, str], ...] = ()) -> Command:
    """The process of one `stage` worker listening on host:port, its peers taken from
    `addrs` (stage -> instance addresses)."""
    wired = peer_lists(peer_roles(stage, bool(w.flag("colocate-prefill"))), addrs)
    cfg = stage_config(stage, {"model": d.model, "device": w.device, "listen": f"{host}:{port}", **wired},
                        w.flags, name)
    return Command(name, stage, (python, "-m", f"services.{stage}", *to_argv(cfg)), port, HEALTH_SERVICES[stage],
                   env)


def to_commands(d: Deployment, host: str, ports: Mapping[str, int], python: str = "python") -> list[Command]:
    """argv of each process (generated from its stage config), ordered decode -> prefill ->
    encode -> monolith -> gateway. Processes bind `host`; peers are reached at `host`
    (127.0.0.1 when binding all interfaces). Workers sharing CPU cores get SHARED_CORES_ENV."""
    if not d.model:
        raise ValueError("the deployment has no model; set model (a checkpoint folder) or use hasctl up")
    check_launchable(d)
    missing = [n for n in process_names(d) if n not in ports]
    if missing:
        raise ValueError(f"no port given for {missing}")
    peer = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    addr = {s: tuple(f"{peer}:{ports[f'{s}-{i}']}" for i in range(len(getattr(d, s)))) for s in STAGES}
    out = [stage_command(d, stage, w, f"{stage}-{i}", host, ports[f"{stage}-{i}"], addr, python,
                         SHARED_CORES_ENV if shares_cores(d, stage, i) else ())
           for stage in STAGES for i, w in enumerate(getattr(d, stage))]
    served = {"served_model_name": d.served_model_name} if d.served_model_name else {}
    gw = stage_config("gateway", {"model": d.model, "listen": f"{host}:{ports['gateway']}", **served,
                                   "http_listen": f"{host}:{ports['gateway-http']}",
                                   **peer_lists(peer_roles("gateway"), addr)},
                       d.gateway.flags, "gateway")
    out.append(Command("gateway", "gateway", (python, "-m", "services.gateway", *to_argv(gw)), ports["gateway"],
                       HEALTH_SERVICES["gateway"]))
    return out


# ---- presets (the design's section 6 baselines) -----------------------------------------------
def _encode(**flags: Any) -> Worker:
    return Worker(flags=_dashed(flags))


# Every preset whose encoder can be idle batches work-conserving (`continuous`: a free encoder
# takes what is pending at once, so a lone request pays no batching wait, while arrivals during a
# busy encode still leave together as one batch of up to 8). The timed modes stay for the named
# baselines (fixed-batch-8) and for `hasctl tune` to choose.
PRESETS: dict[str, Deployment] = {
    "default": Deployment(name="default", encode=(_encode(max_batch=8, remote_fraction=1.0,
                                                          batch_mode="continuous"),)),
    "colocated": Deployment(name="colocated", encode=(_encode(max_batch=8, remote_fraction=0.5,
                                                              batch_mode="continuous", colocate_prefill=True),)),
    "dynamo-like": Deployment(name="dynamo-like", encode=(_encode(max_batch=1, remote_fraction=1.0,
                                                                  batch_mode="request_at_a_time"),)),
    "fixed-batch-8": Deployment(name="fixed-batch-8", encode=(_encode(max_batch=8, remote_fraction=1.0,
                                                                      batch_mode="fixed"),)),
    "monolith": Deployment(name="monolith", prefill=(), decode=(),
                           monolith=(Worker(flags={"sm-backend": "timeslice", "partition-policy": "timeslice",
                                                   "batch-mode": "continuous"}),)),
}
ALIASES = {"passthrough": "dynamo-like", "fixed8": "fixed-batch-8"}  # the names before the paper's


def preset(name: str) -> Deployment:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                         f"(or the old names {sorted(ALIASES)}) or pass --deployment FILE")
    return PRESETS[name]
