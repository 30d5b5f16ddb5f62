"""The search space of `hasctl tune`: allocation x batch mode x B x s -> a `Deployment`. Pure (no I/O).

Candidates:
- every allocation `hasctl.screen.enumerate_allocations(n)` lists for n = 2..instances whole
  E/P/D instances, with and without co-located prefill, that a `Deployment` can run: p >= 1,
  because the gateway sends text-only requests to a prefill worker (the screen's P0 allocations
  are dropped); E0 ones only for a text-only workload;
- `monolith`: encode + prefill + decode in one process on all the devices;
- `monolith-dp` (GPUs, more than one device or tp group): one monolith replica on each device,
  data parallel: the vLLM-like aggregated layout (e.g. 4 x tp2 on 8 GPUs).

Placement (`place`, one of the space's `placements`):
- `split`: the k-th instance of an allocation, counted encode first, then prefill, then decode,
  runs on devices[k % len(devices)] (round robin; on a CPU host the devices are single cores
  `cpu:i`, so with more instances than cores several stages share a core), one torch thread
  per core of its device;
- `shared`: every instance on all the devices at once (`cpu:0-1`; the first device when they
  are GPUs), the OS scheduler sharing the cores among them. On CPU cores, encode (with its
  co-located prefill) and remote prefill, compute-bound, run one torch thread per core, and
  decode `decode_threads` (a drawn parameter: 1, or one per core); a co-located encode there
  draws `sm`: `timeslice` (encode and prefill both use every core, uncontrolled) or `dynamic`
  (the SM backend `auto`, on CPU a per-batch core split, with the dynamic partition policy).
The monolith gets every CPU core (`cpu:0-1`), or the first device when they are GPUs; `monolith-dp` one
replica per device.
With `tp` > 1 (a tensor-parallel profile: `hasctl tune` takes the profile's tp) every instance
spans tp GPUs and `devices` lists each group's first GPU (cuda:0,cuda:2,... for tp 2).

Parameters a trial draws (`suggest`): `alloc` (a candidate's name), `mode` (the encode /
monolith batch mode, from `batch_modes`: by default every mode of `easerve.policy.batcher`),
`B` (max-batch, from `batch_sizes`; not for `request_at_a_time`, which runs batches of one), for an allocation (not the monolith) `place` when the space
has more than one placement (else its only one), `decode_threads` only for a shared placement
on several CPU cores, and, only for a co-located allocation, `s` (the share of requests encode
sends to remote prefill, 0..1 in steps of 0.05).

`warm_starts` names the points a new study tries first (Optuna's `enqueue_trial`), before TPE's
random start-up draws, in this order, as they exist in the space: the baselines a user could
deploy instead (the vLLM-like `monolith-dp`; the Dynamo-like layout: request-at-a-time encode,
every prefill remote, on `dynamo_alloc`), the screen's best allocation (`screened_best`, at the
largest B), then the `default` preset (remote prefill), the `colocated` preset and the monolith,
each at B = 8 with the presets' batching mode (`default`'s `--batch-mode`). A study of at least that many trials so ends at a
deployment as good as each of those on its own objective; each is scored like any other trial.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from easerve.policy.batcher import MODES as BATCH_MODES, batch_limit
from easerve.fields import check_device, cpu_cores
from hasctl.deployment import PRESETS, Deployment, Worker
from hasctl.tensor_parallel import check_tp
from hasctl.screen import Allocation, enumerate_allocations

MONOLITH = "monolith"
MONOLITH_DP = "monolith-dp"
BATCH_SIZES = (1, 2, 4, 8, 16)
S_STEP = 0.05
PLACEMENTS = ("split", "shared")
SM_MODES = {"timeslice": {"sm-backend": "timeslice", "partition-policy": "timeslice"},
            "dynamic": {"sm-backend": "auto", "partition-policy": "dynamic"}}


@dataclass(frozen=True)
class Space:
    """What a trial may pick. `allocations` in a stable order (an optuna categorical's choices)."""
    allocations: tuple[Allocation, ...]
    devices: tuple[str, ...]
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    monolith: bool = True
    batch_modes: tuple[str, ...] = BATCH_MODES
    placements: tuple[str, ...] = ("split",)
    tp: int = 1
    dynamo_alloc: str = ""     # the Dynamo-like warm start's allocation (default: the first non-colocated one)
    screened_best: str = ""    # the screen's best allocation, warm-started at the largest B ("": none)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("devices must name at least one device (cpu:0, cuda:0, ...); pass --cores or --devices")
        for d in self.devices:
            check_device(d)
            check_tp(self.tp, d, f"devices ({d})")
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {self.batch_sizes!r}")
        bad = [a.name for a in self.allocations if a.prefill < 1 or a.decode < 1 or (a.colocated and a.encode < 1)]
        if bad:
            raise ValueError(f"allocations {bad} cannot run: a deployment needs >= 1 prefill and decode worker "
                             f"(and co-location an encode one)")
        if not self.batch_modes or any(m not in BATCH_MODES for m in self.batch_modes):
            raise ValueError(f"batch_modes must be a non-empty subset of {BATCH_MODES}, got {self.batch_modes!r}")
        if not self.placements or any(p not in PLACEMENTS for p in self.placements):
            raise ValueError(f"placements must be a non-empty subset of {PLACEMENTS}, got {self.placements!r}")
        if not self.allocations and not self.monolith:
            raise ValueError("the search space is empty: no allocation kept and the monolith left out")
        names = {a.name for a in self.allocations}
        for k in ("dynamo_alloc", "screened_best"):
            if getattr(self, k) and getattr(self, k) not in names:
                raise ValueError(f"{k} {getattr(self, k)!r} is not one of the allocations {sorted(names)}")

    @property
    def data_parallel(self) -> bool:
        """Whether the space has `monolith-dp`: the monolith on, and several GPU devices (tp groups)."""
        return self.monolith and len(self.devices) > 1 and not any(d.startswith("cpu:") for d in self.devices)

    @property
    def cores(self) -> tuple[int, ...]:
        """The CPU cores of the devices; () when they are GPUs."""
        if any(not d.startswith("cpu:") for d in self.devices):
            return ()
        return tuple(sorted({c for d in self.devices for c in cpu_cores(d)}))

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.allocations) + ((MONOLITH,) if self.monolith else ()) + \
            ((MONOLITH_DP,) if self.data_parallel else ())

    def allocation(self, name: str) -> Allocation | None:
        """The allocation called `name`; None for the monolith (and `monolith-dp`)."""
        if (name == MONOLITH and self.monolith) or (name == MONOLITH_DP and self.data_parallel):
            return None
        for a in self.allocations:
            if a.name == name:
                return a
        raise ValueError(f"{name!r} is not in this search space; choose one of {list(self.choices)}")


def runnable_allocations(instances: int, media: bool = True) -> list[Allocation]:
    """Every allocation of 2..instances instances that a Deployment can run (prefill >= 1;
    encode >= 1 unless the workload is text-only)."""
    if instances < 2:
        raise ValueError(f"instances must be >= 2 (encode with co-located prefill + decode), got {instances}")
    out = []
    for n in range(2, instances + 1):
        out += [a for a in enumerate_allocations(n, media) if a.prefill >= 1]
    return out


def core_devices(cores: Sequence[int]) -> tuple[str, ...]:
    """One `cpu:i` device per core."""
    if not cores:
        raise ValueError("cores must list at least one CPU core")
    return tuple(f"cpu:{c}" for c in sorted(set(cores)))


class Trial(Protocol):  # what `suggest` uses of an optuna trial
    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None) -> float: ...


def suggest(trial: Trial, space: Space) -> dict[str, Any]:
    """Draw one point: {'alloc': name, 'mode': str, ['B': int], ['place': str, ['decode_threads': int,
    ['sm': str]]], ['s': float]}."""
    params: dict[str, Any] = {"alloc": trial.suggest_categorical("alloc", list(space.choices)),
                              "mode": trial.suggest_categorical("mode", list(space.batch_modes))}
    if params["mode"] != "request_at_a_time":
        params["B"] = trial.suggest_categorical("B", list(space.batch_sizes))
    a = space.allocation(params["alloc"])
    if a is not None and len(space.placements) > 1:
        params["place"] = trial.suggest_categorical("place", list(space.placements))
    if a is not None and params.get("place", space.placements[0]) == "shared" and len(space.cores) > 1:
        params["decode_threads"] = trial.suggest_categorical("decode_threads", [1, len(space.cores)])
    if "decode_threads" in params and a.colocated:
        params["sm"] = trial.suggest_categorical("sm", list(SM_MODES))
    if a is not None and a.colocated:
        params["s"] = round(trial.suggest_float("s", 0.0, 1.0, step=S_STEP), 6)  # 0.85, not 0.8500000000000001
    return params


WARM_B = 8  # the presets' encode max-batch


class _Preferred:
    """A stand-in trial answering `suggest` with preferred values where they are choices
    (else the first choice), so a warm start passes the same code path as a drawn point."""

    def __init__(self, prefer: Mapping[str, Any]):
        self.prefer = prefer

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        want = self.prefer.get(name)
        return want if want in choices else choices[0]

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None) -> float:
        return min(max(float(self.prefer.get(name, low)), low), high)


def warm_starts(space: Space) -> list[dict[str, Any]]:
    """The baselines', the screen's and the presets' points in `space` (see the module docstring),
    without repeats."""
    b = max([x for x in space.batch_sizes if x <= WARM_B] or [min(space.batch_sizes)])
    mode = dict(PRESETS["default"].encode[0].flags).get("batch-mode", "adaptive")  # the presets' batching
    base = {"B": b, "mode": mode, "place": "shared", "decode_threads": 1, "sm": "dynamic", "s": 0.5}
    plain = next((a.name for a in space.allocations if not a.colocated and a.encode), None)
    coloc = next((a.name for a in space.allocations if a.colocated), None)
    dynamo = space.dynamo_alloc or plain
    wanted = [({"alloc": MONOLITH_DP} if space.data_parallel else None),
              ({"alloc": dynamo, "mode": "request_at_a_time", "place": "split"} if dynamo else None),
              ({"alloc": space.screened_best, "B": max(space.batch_sizes)} if space.screened_best else None),
              *({"alloc": n} for n in (plain, coloc, MONOLITH if space.monolith else None) if n)]
    out: list[dict[str, Any]] = []
    for want in filter(None, wanted):
        p = suggest(_Preferred({**base, **want}), space)
        if p not in out:
            out.append(p)
    return out


def deployment_for(space: Space, params: Mapping[str, Any], model: str, name: str = "tuned") -> Deployment:
    """The Deployment of one point of the space (gateway on ports 0: assigned at launch). A point
    without 'mode' batches adaptively; request_at_a_time runs with max-batch 1, whatever 'B'."""
    a = space.allocation(params["alloc"])
    mode = params.get("mode", "adaptive")
    if mode not in space.batch_modes:
        raise ValueError(f"mode {mode!r} is not in this search space; choose one of {list(space.batch_modes)}")
    b = batch_limit(mode, int(params["B"]) if "B" in params else None)
    if b is None:
        raise ValueError(f"batch mode {mode!r} needs 'B' (max-batch) in the params")
    if a is None:
        flags = {**dict(PRESETS[MONOLITH].monolith[0].flags), "max-batch": b, "batch-mode": mode}
        where = space.devices if params["alloc"] == MONOLITH_DP else (_all_of(space.devices),)
        return Deployment(name=name, model=model, prefill=(), decode=(),
                          monolith=tuple(Worker(device=x, flags=flags, tp=space.tp) for x in where)
                          ).with_gateway_ports(0, 0)
    if a.colocated and "s" not in params:
        raise ValueError(f"{a.name} co-locates prefill: params need 's' (remote fraction in [0, 1])")
    enc_flags: dict[str, Any] = {"max-batch": b, "batch-mode": mode, "remote-fraction": 1.0}
    if a.colocated:
        enc_flags |= {"colocate-prefill": True, "remote-fraction": float(params["s"])}
    place = params.get("place", space.placements[0])
    if place not in space.placements:
        raise ValueError(f"place {place!r} is not in this search space; choose one of {list(space.placements)}")
    if place == "shared":
        if a.colocated and "sm" in params:
            if params["sm"] not in SM_MODES:
                raise ValueError(f"sm must be one of {list(SM_MODES)}, got {params['sm']!r}")
            enc_flags |= SM_MODES[params["sm"]]
        return _shared(space, a, enc_flags, int(params.get("decode_threads", 1)), model, name)
    devs = iter(range(a.encode + a.prefill + a.decode))
    dev = space.devices

    def workers(n: int, flags: dict[str, Any] | None = None) -> tuple[Worker, ...]:
        return tuple(Worker(device=dev[next(devs) % len(dev)], flags=flags or {}, tp=space.tp) for _ in range(n))
    return Deployment(name=name, model=model, encode=workers(a.encode, enc_flags), prefill=workers(a.prefill),
                      decode=workers(a.decode)).with_gateway_ports(0, 0)


def _shared(space: Space, a: Allocation, enc_flags: dict[str, Any], decode_threads: int, model: str,
            name: str) -> Deployment:
    """Every instance on all the devices; on CPU cores encode / prefill with a thread per core."""
    dev, n = _all_of(space.devices), len(space.cores)
    if n and not 1 <= decode_threads <= n:
        raise ValueError(f"decode_threads must be in 1..{n} (the cores), got {decode_threads}")
    compute = {"threads": n} if n else {}
    dec = {"threads": decode_threads} if n else {}

    def workers(k: int, flags: dict[str, Any]) -> tuple[Worker, ...]:
        return tuple(Worker(device=dev, flags=flags, tp=space.tp) for _ in range(k))
    return Deployment(name=name, model=model, encode=workers(a.encode, {**enc_flags, **compute}),
                      prefill=workers(a.prefill, compute), decode=workers(a.decode, dec)).with_gateway_ports(0, 0)


def _all_of(devices: Sequence[str]) -> str:
    """One device holding all of `devices`: their cores for CPUs (`cpu:0-3`), else the first."""
    cores = sorted({c for d in devices for c in (cpu_cores(d) or ())})
    if not cores or any(not d.startswith("cpu:") for d in devices):
        return devices[0]
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return "cpu:" + ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)
