"""`hasctl k8s`: Kubernetes manifests for a deployment (several nodes, same image).

    hasctl k8s --deployment best.yaml --namespace serving --image registry/easerve:0.1 | kubectl apply -f -

What it writes, from the deployment file:
- a ConfigMap holding the deployment file itself (mounted at /etc/easerve/deployment.yaml; its
  hash is a pod annotation, so a changed deployment rolls the pods);
- per stage (decode, prefill, encode): a StatefulSet of its instances and a headless Service.
  Peers are passed the headless Service's name (`easerve-decode.<ns>.svc.cluster.local:50054`),
  which resolves to the address of every ready instance; the stages look it up again every
  --peer-refresh-s and keep one channel per address (easerve.stages.common.peer_sources), so
  `kubectl scale statefulset easerve-prefill --replicas 4` is followed without a restart, and a
  pod that drains (NOT_SERVING, so not ready) leaves the records and gets no new calls. The KV
  of a request goes to the decode address the gateway reserved at, which its prefill finds
  among the same records. Instances whose flags or devices differ get one StatefulSet (and
  Service) each (`easerve-encode-0`, `easerve-encode-1`).
- the gateway: a Deployment and a Service (gRPC and the OpenAI HTTP port).
Each container runs exactly the argv `hasctl.deployment.to_commands` gives the launcher, but
for addresses: it binds 0.0.0.0 and names peers by DNS. Devices: cuda:N -> one
`nvidia.com/gpu` (the pod sees it as cuda:0); cpu -> a CPU request (the core count of a
`cpu:0-3` device, else --threads, else 1). Probes are grpc.health.v1: startup and liveness on
the server (""), readiness on the stage's service. Removal (scale-down, rollout, eviction): a
preStop hook sleeps while the pod leaves the Service's records and its callers look them up
again (`notice_s`: --peer-refresh-s and a poll), then SIGTERM starts the stage's drain (new
calls refused UNAVAILABLE, every accepted one finished, easerve.rpc.drain);
terminationGracePeriodSeconds covers the preStop sleep plus the whole drain (`stop_s`:
--drain-timeout-s + --grace-s) plus a margin, so the kubelet's SIGKILL never cuts a drain. An init container waits until each downstream stage has
an instance SERVING (what depends_on: service_healthy does in compose). With no model in the
deployment the pods serve the tiny checkpoint the image carries; otherwise the model comes
from a PersistentVolumeClaim (`--model-claim`, default easerve-model) mounted at /models, or, for a hub
id (ORG/NAME[@REVISION]), each pod fetches the files its stage loads into HF_HOME=/hf-home (an
emptyDir, or the PVC `--hf-home-claim`), with HF_TOKEN from the Secret `--hf-token-secret` if it exists.
The KV transport is left to the stages (pods do not share /dev/shm; across pods it is gRPC).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from easerve.models.hub import parse_hub_id
from hasctl.compose import (HF_HOME_DIR, MODEL_DIR, core_count, cpu_cores, dump, flag_value, is_gpu, load_deployment,
                            replace_flag, scrape_labels, served_name)
from hasctl.autoscale import parse_min_max
from hasctl.deployment import HEALTH_SERVICES, STAGES, Deployment, Worker, notice_s, stop_s, to_commands
from hasctl.tensor_parallel import check_launchable

STAGE_PORTS = {"encode": 50052, "prefill": 50053, "decode": 50054, "monolith": 50055}  # a worker's port when its port is 0
_PEER_FLAGS = ("--decode", "--prefill", "--encode")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
GRACE_MARGIN_S = 15
METRICS_PORT = 9100  # every stage pod's /metrics (encode: /trace too); the gateway's is on its HTTP port
DESIRED_METRIC = "easerve_desired_instances"  # easerve:desired_instances as the metrics adapter serves it


@dataclass(frozen=True)
class K8sOptions:
    namespace: str = "easerve"
    image: str = "easerve:latest"
    prefix: str = "easerve"
    cluster_domain: str = "cluster.local"
    model_claim: str = "easerve-model"     # PVC with the checkpoint, when the deployment names one
    hf_home_claim: str = ""                # a hub id: PVC holding HF_HOME ("": an emptyDir per pod)
    hf_token_secret: str = "hf-token"      # a hub id: Secret whose key HF_TOKEN is passed (optional)
    gateway_service_type: str = "ClusterIP"
    autoscale: tuple[int, int] | None = None  # MIN:MAX replicas of a HorizontalPodAutoscaler per stage

    def __post_init__(self) -> None:
        for field in ("namespace", "prefix", "model_claim"):
            value = getattr(self, field)
            if not _DNS_LABEL.match(value) or len(value) > 40:
                raise ValueError(f"{field} must be a DNS label (lowercase letters, digits, '-'; "
                                 f"at most 40 characters), got {value!r}")
        if not self.image:
            raise ValueError("image must name the EAServe image, e.g. registry.example/easerve:0.1")
        if self.autoscale is not None and not 1 <= self.autoscale[0] <= self.autoscale[1]:
            raise ValueError(f"autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {self.autoscale}")
        if self.gateway_service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
            raise ValueError(f"gateway_service_type must be ClusterIP, NodePort or LoadBalancer, "
                             f"got {self.gateway_service_type!r}")


@dataclass(frozen=True)
class Group:
    """One StatefulSet: the instances of a stage that share a pod spec."""
    stage: str
    name: str
    instances: tuple[int, ...]   # indices into the deployment's list of that stage
    worker: Worker               # as the pod runs it (cuda:0 / cpu)
    source_device: str           # the deployment's device of these instances

    @property
    def port(self) -> int:
        """Every pod has its own address, so a stage's port is the same in all (a port fixed for
        one host does not carry over)."""
        return STAGE_PORTS[self.stage]


def _pod_worker(w: Worker) -> Worker:
    """The worker as its pod runs it: its GPU is the pod's cuda:0 (ports: Group.port)."""
    return dataclasses.replace(w, device="cuda:0" if is_gpu(w.device) else "cpu", port=0)


def groups(d: Deployment, opts: K8sOptions) -> list[Group]:
    out = []
    for stage in STAGES:
        keyed: dict[tuple, list[int]] = {}
        for i, w in enumerate(getattr(d, stage)):
            pw = _pod_worker(w)
            keyed.setdefault((pw, w.device if cpu_cores(w.device) else pw.device), []).append(i)
        for g, ((pw, device), idx) in enumerate(keyed.items()):
            name = f"{opts.prefix}-{stage}" + (f"-{g}" if len(keyed) > 1 else "")
            out.append(Group(stage, name, tuple(idx), pw, device))
    return out


def _service_names(gs: list[Group], opts: K8sOptions) -> dict[str, str]:
    """process name (decode-1) -> the DNS name and port of its group's headless Service."""
    return {f"{g.stage}-{i}": f"{g.name}.{opts.namespace}.svc.{opts.cluster_domain}:{g.port}"
            for g in gs for i in g.instances}


def pod_commands(d: Deployment, opts: K8sOptions) -> tuple[list[Group], dict[str, list[str]]]:
    """The groups and the argv of each process (decode-0, ..., gateway) as the pods run it."""
    check_launchable(d)  # before devices become the pod's cuda:0
    gs = groups(d, opts)
    by_proc = {f"{g.stage}-{i}": g for g in gs for i in g.instances}
    pod_d = dataclasses.replace(d, **{s: tuple(by_proc[f"{s}-{i}"].worker for i in range(len(getattr(d, s))))
                                      for s in STAGES})
    pod_d = pod_d if parse_hub_id(d.model) else pod_d.with_model(MODEL_DIR)
    if not dict(d.gateway.flags).get("served-model-name"):
        pod_d = pod_d.with_flags("gateway", served_model_name=served_name(d.model))
    ports = {n: g.port for n, g in by_proc.items()}
    ports.update(gateway=d.gateway.grpc_port or 50051, **{"gateway-http": d.gateway.http_port or 8000})
    names = _service_names(gs, opts)
    argvs = {}
    for cmd in to_commands(pod_d, "0.0.0.0", ports):
        argv = list(cmd.argv)
        for flag in _PEER_FLAGS:
            value = flag_value(argv, flag)
            if value is not None:
                stage = flag.removeprefix("--")
                peers = [f"{stage}-{i}" for i in range(len(getattr(d, stage)))]
                if cmd.stage == "gateway":  # the gateway reaches a monolith as every stage
                    peers += [f"monolith-{i}" for i in range(len(d.monolith))]
                assert len(peers) == len(value.split(",")), (cmd.name, flag, value)
                argv = replace_flag(argv, flag, ",".join(dict.fromkeys(names[n] for n in peers)))
        if cmd.stage != "gateway" and "--metrics-listen" not in argv:
            argv += ["--metrics-listen", f"0.0.0.0:{METRICS_PORT}"]
        argvs[cmd.name] = argv
    return gs, argvs


# ---- objects ------------------------------------------------------------------------------------
def _labels(d: Deployment, opts: K8sOptions, component: str) -> dict:
    return {"app.kubernetes.io/name": "easerve", "app.kubernetes.io/instance": opts.prefix,
            "app.kubernetes.io/component": component, "easerve.io/deployment": _label_value(d.name)}


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return value or "custom"


def _meta(name: str, opts: K8sOptions, labels: dict) -> dict:
    return {"name": name, "namespace": opts.namespace, "labels": labels}


def _probe(port: int, service: str, period: int, failures: int) -> dict:
    return {"grpc": {"port": port, "service": service}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _resources(g: Group | None) -> dict:
    if g is None:
        return {"requests": {"cpu": "1"}}
    if is_gpu(g.source_device):
        return {"limits": {"nvidia.com/gpu": 1}}
    cores = cpu_cores(g.source_device)
    threads = g.worker.flag("threads", 0)
    n = core_count(cores) if cores else (threads if isinstance(threads, int) and threads > 0 else 1)
    return {"requests": {"cpu": str(n)}}


def _wait_for(deps: dict[str, list[str]]) -> str:
    """Shell: block until each dependency stage has one instance SERVING."""
    lines = []
    for stage, addrs in deps.items():
        checks = " || ".join(f"python -m easerve.healthcheck {shlex.quote(a)} {HEALTH_SERVICES[stage]} >/dev/null"
                             for a in addrs)
        lines.append(f"until {checks}; do echo waiting for {stage}; sleep 2; done")
    return "; ".join(lines)


def _pod_spec(d: Deployment, opts: K8sOptions, g: Group | None, argv: list[str], stage: str,
              ports: list[dict], flags, model_claim: bool) -> dict:
    port = ports[0]["containerPort"]
    health = HEALTH_SERVICES[stage]
    mounts = [{"name": "deployment", "mountPath": "/etc/easerve", "readOnly": True},
              {"name": "shm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "deployment", "configMap": {"name": f"{opts.prefix}-deployment"}},
               {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    env = [{"name": "EASERVE_LOG_LEVEL", "value": "INFO"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if parse_hub_id(d.model):
        mounts.append({"name": "hf-home", "mountPath": HF_HOME_DIR})
        volumes.append({"name": "hf-home", **({"persistentVolumeClaim": {"claimName": opts.hf_home_claim}}
                                              if opts.hf_home_claim else {"emptyDir": {}})})
        env += [{"name": "HF_HOME", "value": HF_HOME_DIR},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": opts.hf_token_secret, "key": "HF_TOKEN",
                                                                    "optional": True}}}]
    elif model_claim:
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": opts.model_claim, "readOnly": True}})
    container = {
        "name": stage, "image": opts.image, "imagePullPolicy": "IfNotPresent", "command": argv,
        "ports": ports,
        "env": env,
        "resources": _resources(g),
        "startupProbe": _probe(port, "", 5, 120),          # model load and warm-up: up to 10 min
        "livenessProbe": _probe(port, "", 10, 3),
        "readinessProbe": _probe(port, health, 5, 2),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(math.ceil(notice_s(d)))]}}},
    }
    termination = math.ceil(notice_s(d)) + math.ceil(stop_s(flags)) + GRACE_MARGIN_S
    spec: dict[str, Any] = {"enableServiceLinks": False, "terminationGracePeriodSeconds": termination,
                            "containers": [container], "volumes": volumes}
    deps = _peer_addrs(argv)
    if deps:
        spec["initContainers"] = [{"name": "wait-for-peers", "image": opts.image, "imagePullPolicy": "IfNotPresent",
                                   "command": ["sh", "-c", _wait_for(deps)]}]
    return spec


def _peer_addrs(argv: list[str]) -> dict[str, list[str]]:
    return {f.removeprefix("--"): v.split(",") for f in _PEER_FLAGS if (v := flag_value(argv, f))}


def manifests(d: Deployment, opts: K8sOptions = K8sOptions()) -> list[dict]:
    """Every object, in apply order."""
    gs, argvs = pod_commands(d, opts)
    text = d.dumps("yaml")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    claim = bool(d.model)
    out: list[dict] = []
    scaled: set[str] = set()
    if opts.namespace != "default":
        out.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": opts.namespace}})
    out.append({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": _meta(f"{opts.prefix}-deployment", opts, _labels(d, opts, "config")),
                "data": {"deployment.yaml": text}})
    for g in gs:
        labels = {**_labels(d, opts, g.stage), "easerve.io/workload": g.name}
        port = g.port
        argv = argvs[f"{g.stage}-{g.instances[0]}"]
        mport = int(flag_value(argv, "--metrics-listen").rpartition(":")[2])
        pod = _pod_spec(d, opts, g, argv, g.stage, [{"name": "grpc", "containerPort": port},
                                                    {"name": "metrics", "containerPort": mport}],
                        g.worker.flags, claim)
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(g.name, opts, labels),
                    "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": labels,
                             "ports": [{"name": "grpc", "port": port, "targetPort": port}]}})
        out.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(g.name, opts, labels),
                    "spec": {"serviceName": g.name, "replicas": len(g.instances), "podManagementPolicy": "Parallel",
                             "selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels,
                                                       "annotations": {"easerve.io/deployment-sha256": digest,
                                                                       **scrape_labels(mport)}},
                                          "spec": pod}}})
        if opts.autoscale is not None and g.stage != "monolith" and g.stage not in scaled:
            scaled.add(g.stage)  # one per stage, on its first group (any others keep their replicas)
            out.append(_hpa(g, opts, labels))
    out += _gateway(d, opts, argvs["gateway"], digest, claim)
    return out


def _hpa(g: Group, opts: K8sOptions, labels: dict) -> dict:
    """A HorizontalPodAutoscaler (autoscaling/v2) of the group's StatefulSet on the external
    metric easerve_desired_instances{stage}: with an AverageValue target of 1 the HPA's desired
    replicas are the metric's value (the online controller's desired count), within MIN:MAX."""
    lo, hi = opts.autoscale
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(g.name, opts, labels),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": g.name},
                     "minReplicas": lo, "maxReplicas": hi,
                     "metrics": [{"type": "External", "external": {
                         "metric": {"name": DESIRED_METRIC, "selector": {"matchLabels": {"stage": g.stage}}},
                         "target": {"type": "AverageValue", "averageValue": "1"}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def _gateway(d: Deployment, opts: K8sOptions, argv: list[str], digest: str, claim: bool) -> list[dict]:
    name = f"{opts.prefix}-gateway"
    labels = _labels(d, opts, "gateway")
    grpc_port = int(flag_value(argv, "--listen").rpartition(":")[2])
    http_port = int(flag_value(argv, "--http-listen").rpartition(":")[2])
    ports = [{"name": "grpc", "containerPort": grpc_port}, {"name": "http", "containerPort": http_port}]
    pod = _pod_spec(d, opts, None, argv, "gateway", ports, d.gateway.flags, claim)
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, opts, labels),
         "spec": {"type": opts.gateway_service_type, "selector": labels,
                  "ports": [{"name": "grpc", "port": grpc_port, "targetPort": grpc_port},
                            {"name": "http", "port": http_port, "targetPort": http_port}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, opts, labels),
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels, "annotations": {"easerve.io/deployment-sha256": digest,
                                                                              **scrape_labels(http_port)}},
                               "spec": pod}}},
    ]


# ---- the command --------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("k8s", help="write Kubernetes manifests for a deployment")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--deployment", default=None, help="a deployment file (.json / .yaml), e.g. from hasctl tune")
    src.add_argument("--preset", default=None, help="a named deployment (default: default)")
    p.add_argument("--namespace", default=K8sOptions.namespace, help="namespace of every object (default: easerve)")
    p.add_argument("--image", default=K8sOptions.image, help="the EAServe image the cluster can pull")
    p.add_argument("--prefix", default=K8sOptions.prefix, help="name prefix of the objects (default: easerve)")
    p.add_argument("--cluster-domain", default=K8sOptions.cluster_domain)
    p.add_argument("--model-claim", default=K8sOptions.model_claim,
                   help="PersistentVolumeClaim holding the deployment's model folder (mounted at /models)")
    p.add_argument("--hf-home-claim", default=K8sOptions.hf_home_claim,
                   help="a hub-id model: PersistentVolumeClaim holding HF_HOME, shared by the pods (default: an "
                        "emptyDir per pod, each fetching only its stage's files)")
    p.add_argument("--hf-token-secret", default=K8sOptions.hf_token_secret,
                   help="a hub-id model: Secret whose key HF_TOKEN the pods get (skipped when absent)")
    p.add_argument("--gateway-service-type", default=K8sOptions.gateway_service_type,
                   choices=["ClusterIP", "NodePort", "LoadBalancer"])
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="a HorizontalPodAutoscaler per stage on easerve_desired_instances{stage} (the encode's "
                        "--online controller exports it; served by prometheus-adapter, see docs/deploy.md)")
    p.add_argument("--out", default=None, help="a folder: one file per object (default: one stream on stdout)")
    p.set_defaults(func=run)


def run(args) -> int:
    opts = K8sOptions(namespace=args.namespace, image=args.image, prefix=args.prefix,
                      cluster_domain=args.cluster_domain, model_claim=args.model_claim,
                      hf_home_claim=args.hf_home_claim, hf_token_secret=args.hf_token_secret,
                      gateway_service_type=args.gateway_service_type, autoscale=parse_min_max(args.autoscale) if args.autoscale else None)
    objs = manifests(load_deployment(args), opts)
    if args.out is None:
        sys.stdout.write("".join("---\n" + dump(o) for o in objs))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, o in enumerate(objs):
        path = out / f"{i:02d}-{o['kind'].lower()}-{o['metadata']['name']}.yaml"
        path.write_text(dump(o))
    print(f"wrote {len(objs)} manifests to {out}")
    return 0
