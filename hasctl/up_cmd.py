"""`hasctl up`: launch a deployment (a preset or a deployment file) on this host and keep it up.

With no --model and no model in the deployment, the default tiny checkpoint is built (once,
offline) under ~/.cache/easerve/tiny and served. Ctrl-C or SIGTERM stops every process.
"""
from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import dataclasses

from easerve.stages.common.configs import DTYPES
from hasctl.deployment import ALIASES, PRESETS, STAGES, Deployment, preset

DEFAULT_TINY_ROOT = "~/.cache/easerve/tiny"


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="launch a deployment on this host (default: the tiny model, preset 'default')")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted([*PRESETS, *ALIASES]),
                     help="a named deployment (default: default)")
    src.add_argument("--deployment", default=None, help="a deployment file (.json / .yaml), e.g. from hasctl tune")
    p.add_argument("--model", default=None, help="checkpoint folder or hub id ORG/NAME[@REVISION] (fetched through "
                   "huggingface_hub: HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply); default: the deployment's, else the "
                   "tiny model")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the deployment's, else the hub id "
                        "or folder name)")
    p.add_argument("--device", default=None, help="put every stage on this device (cpu, cuda:0, ...)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="every stage's weights dtype (default: the deployment's, else auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds (default loopback only; "
                   "0.0.0.0 or a host address to be reached from elsewhere)")
    p.add_argument("--api-key-file", default=None, help="gateway API keys, one a line (clients send Bearer KEY)")
    p.add_argument("--admission", default=None, choices=("off", "reject", "best-effort"),
                   help="gateway SLO-aware admission (needs --profile); default: the deployment's, else off")
    p.add_argument("--profile", default=None, help="hasctl profile file of this deployment: the gateway's latency "
                   "predictor and SLO tiers")
    p.add_argument("--slo-tier", default=None, choices=("tight", "moderate", "loose"),
                   help="default SLO tier of a request (default: the deployment's, else moderate)")
    p.add_argument("--tls-cert", default="", help="PEM certificate every process serves TLS with (SANs: --host)")
    p.add_argument("--tls-key", default="", help="its PEM private key")
    p.add_argument("--tls-ca", default="", help="PEM CA that verifies the processes' certificates")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI HTTP port (default: deployment's, 8000)")
    p.add_argument("--grpc-port", type=int, default=None, help="gateway gRPC port (default: deployment's, 50051)")
    p.add_argument("--base-port", type=int, default=None, help="first port of the stage processes (default: free ports)")
    p.add_argument("--run-dir", default=None, help="folder for the per-stage logs (default: a new temp folder)")
    p.add_argument("--standby", action="store_true",
                   help="keep a pre-imported standby per stage process: a restart after a crash takes seconds, "
                        "not a cold start (costs one idle process's memory per stage process)")
    p.add_argument("--fork", action="store_true",
                   help="fork every stage process, and each restart, from one process that imported the stage "
                        "code once (no per-process standby; a restart costs its model load, not ~4 CPU-s of imports)")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not serve each stage's /metrics (and encode's /trace) on the free ports `up` prints")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="run encode with --online and add / drain instances of each stage to the count it asks "
                        "for (easerve:desired_instances), within MIN:MAX")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every stage to serve")
    p.set_defaults(func=run)


def resolve(args) -> Deployment:
    """The deployment the flags describe, with a model."""
    d = Deployment.load(args.deployment) if args.deployment else preset(args.preset or "default")
    if args.device:
        d = d.with_device(args.device)
    if args.dtype:
        for stage in STAGES:
            d = d.with_flags(stage, dtype=args.dtype)
    if args.served_model_name is not None:
        d = dataclasses.replace(d, served_model_name=args.served_model_name)
    if getattr(args, "autoscale", None):
        from hasctl.autoscale import parse_min_max
        lo, hi = parse_min_max(args.autoscale)
        from hasctl.autoscale import counts_file
        args.run_dir = args.run_dir or tempfile.mkdtemp(prefix="easerve-run-")
        d = d.with_flags("encode", online=True, online_instances=f"{lo}:{hi}",
                         online_instances_file=str(counts_file(Path(args.run_dir).resolve())))
    if args.api_key_file:
        d = d.with_flags("gateway", api_key_file=str(Path(args.api_key_file).resolve()))
    gw = {k: v for k, v in (("admission", args.admission), ("slo_tier", args.slo_tier),
                            ("profile", args.profile and str(Path(args.profile).resolve()))) if v}
    if gw:
        d = d.with_flags("gateway", **gw)
    g = d.gateway
    d = d.with_gateway_ports(g.grpc_port if args.grpc_port is None else args.grpc_port,
                             g.http_port if args.http_port is None else args.http_port)
    model = args.model or d.model
    if not model:
        from easerve.models.tiny import DEFAULT_FAMILY, cached_tiny
        print(f"no --model: using the tiny {DEFAULT_FAMILY} checkpoint (built once under {DEFAULT_TINY_ROOT})",
              flush=True)
        model = str(cached_tiny(DEFAULT_FAMILY, Path(DEFAULT_TINY_ROOT).expanduser()))
    d = d.with_model(model)
    d.fetch_model()  # a hub id: its files now, with the progress bar (offline and not cached: the error, at once)
    return d


def _notice_if_tiny(model: str) -> None:
    from easerve.models.tiny.build import is_tiny, tiny_notice
    if is_tiny(model):
        print(tiny_notice(model), flush=True)


def run(args) -> int:
    from hasctl.launch import Stack, StageExited

    from easerve.rpc.tls import Tls

    from hasctl.autoscale import Autoscaler, parse_min_max

    if args.autoscale and args.no_metrics:
        raise ValueError("--autoscale reads the encode instances' /metrics: drop --no-metrics")
    tls = Tls(*(str(Path(f).resolve()) if f else "" for f in (args.tls_cert, args.tls_key, args.tls_ca)))
    stack = Stack(resolve(args), host=args.host, base_port=args.base_port, run_dir=args.run_dir, tls=tls,
                  standby=args.standby, fork=args.fork, metrics=not args.no_metrics)
    _notice_if_tiny(stack.deployment.model)
    print(f"starting {stack.deployment.name} ({len(stack.pids)} processes), logs in {stack.run_dir}", flush=True)
    done, scaler = threading.Event(), None
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        stack.start(timeout=args.startup_timeout)
        _print_endpoints(stack)
        _notice_if_tiny(stack.deployment.model)
        if args.autoscale:
            scaler = Autoscaler(stack, parse_min_max(args.autoscale)).start()
        _wait(done, stack)
    except (StageExited, TimeoutError) as e:
        print(f"hasctl up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        print("stopping...", flush=True)
        if scaler is not None:
            scaler.stop()
        stack.stop()
    print(f"stopped; restarts: {stack.restarts}", flush=True)
    return 0


def _print_endpoints(stack) -> None:
    e = stack.endpoints
    print(f"EAServe is up ({stack.deployment.model})\n"
          f"  OpenAI HTTP : {e.openai_base_url}   (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)\n"
          f"  gRPC        : {e.grpc}   (easerve.Client)", flush=True)
    for name, addr in e.stages.items():
        print(f"  {name:<12}: {addr}", flush=True)
    for name, url in e.metrics.items():
        extra = f"   ({url}/trace)" if name.startswith("encode") else ""
        print(f"  metrics {name:<12}: {url}/metrics{extra}", flush=True)


def _wait(done: threading.Event, stack) -> None:
    seen = dict(stack.restarts)
    while not done.wait(1.0):
        now = stack.restarts
        for name, n in now.items():
            if n != seen.get(name):
                print(f"{time.strftime('%H:%M:%S')} restarted {name} (restart #{n}); log: "
                      f"{stack.run_dir / (name + '.log')}", flush=True)
        seen = now
