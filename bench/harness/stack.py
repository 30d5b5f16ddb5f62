"""The stacks a bench starts: a preset (or deployment file) on the bench's checkpoint, gateway
ports picked free, one torch thread per stage, quiet logs; several at once; their metrics."""
from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from typing import Callable

ENV = {"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}


def deployment(model: str, preset_name: str = "default", path: str | None = None, threads: int | None = 1,
               grace_s: float | None = None, **stage_flags: dict):
    """The preset (or the deployment file at `path`) serving `model` on free gateway ports, every
    stage it has with `threads` torch threads and `grace_s` (None: the stage's default), plus
    stage_flags[stage] (for "gateway" too)."""
    from hasctl.deployment import STAGES, Deployment, preset
    d = (Deployment.load(path) if path else preset(preset_name)).with_model(model).with_gateway_ports(0, 0)
    common = {k: v for k, v in (("threads", threads), ("grace_s", grace_s)) if v is not None}
    for stage in STAGES:
        if getattr(d, stage):
            d = d.with_flags(stage, **common, **stage_flags.get(stage, {}))
    gateway = ({"grace_s": grace_s} if grace_s is not None else {}) | stage_flags.get("gateway", {})
    return d.with_flags("gateway", **gateway) if gateway else d


def start(d, *, metrics: bool = False, env: dict | None = None, timeout: float = 600.0, **stack_kw):
    """Start the deployment (`metrics`: every stage serves /metrics, see Stack.endpoints.metrics;
    stack_kw: more of Stack's arguments); returns the started Stack."""
    from hasctl.launch import Stack
    return Stack(d, env=ENV if env is None else env, metrics=metrics, **stack_kw).start(timeout=timeout)


def start_all(starts: dict[str, Callable]) -> dict:
    """Start stacks at once (name -> a call returning a started Stack); if one fails to start,
    stop the others and raise its error."""
    stacks, errors = {}, []
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futs = {name: pool.submit(make) for name, make in starts.items()}
        for name, fut in futs.items():
            try:
                stacks[name] = fut.result()
            except Exception as e:  # noqa: BLE001 - stop the others, then raise
                errors.append(e)
    if errors:
        stop_all(stacks, grace_s=1.0)
        raise errors[0]
    return stacks


def stop_all(stacks: dict, grace_s: float = 15.0) -> None:
    """Stop the stacks in parallel."""
    if stacks:
        with concurrent.futures.ThreadPoolExecutor(len(stacks)) as pool:
            list(pool.map(lambda st: st.stop(grace_s=grace_s), stacks.values()))


def get(url: str, timeout: float = 10.0) -> bytes:
    return urllib.request.urlopen(url, timeout=timeout).read()


def metric_families(stack, process: str = "encode-0") -> list:
    """The Prometheus metric families a process of the stack serves (the stack needs metrics=True
    for a stage process; "gateway" always serves them)."""
    from prometheus_client.parser import text_string_to_metric_families
    return list(text_string_to_metric_families(get(stack.endpoints.metrics[process] + "/metrics").decode()))


def counter(url: str, name: str) -> float:
    """A counter from the /metrics at base `url` (0 before it first counts)."""
    text = get(url + "/metrics").decode()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def trace_records(url: str) -> list[dict]:
    """The gateway's per-request trace (GET /trace)."""
    return json.loads(get(url + "/trace?last=100000"))["requests"]
