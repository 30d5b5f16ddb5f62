"""`hasctl tune`: search allocation x batch mode x B x s for the most goodput at a rate, on real deployments.

Optuna TPE (seeded, ask/tell) over `hasctl.tune_space`. Each trial builds the Deployment, starts
it with `hasctl.launch.Stack`, sends a few warm-up requests, replays the same seeded workload
with `hasctl.bench.run_bench`, records goodput (requests/s meeting the SLO) as the trial's value
and the full metrics as its `metrics` user attribute, and stops the stack in a `finally` (also
when the trial fails or Ctrl-C arrives). A stack that does not start, or a bench that cannot
reach it, fails that trial with its reason in the `error` attribute; the search goes on.

The study lives in --storage (e.g. sqlite:///tune.db) under --study and is resumed when it
exists: the seed and the workload it was made with are kept in the study's `tune` attribute and
a rerun must match them. SIGINT / SIGTERM: the running trial's stack is stopped, the trial is
marked failed ("interrupted") and its parameters are queued so the next run tries them first;
the command exits 130. Trials an earlier run left RUNNING (it was killed) are marked failed when
the study is opened again: run one tuner per study at a time. A new study first runs the
baselines', the screen's and the presets' points (`tune_space.warm_starts`; `--no-warm-start`
leaves them out), then TPE's draws.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from easerve.policy.batcher import MODES as BATCH_MODES
from hasctl.bench_metrics import SLO
from hasctl.deployment import Deployment, GatewaySpec
from hasctl.tune_space import (BATCH_SIZES, PLACEMENTS, Space, core_devices, deployment_for, runnable_allocations,
                               suggest, warm_starts)
from hasctl.workload import MODALITIES, WorkloadSpec, parse_size, steady_requests

EVALUATORS = ("live", "sim")
SIM_MIN_DURATION_S = 60.0  # --sim-min-duration-s default
INTERRUPTED = "interrupted (SIGINT/SIGTERM) while running; its parameters are queued for the next run"


class TrialFailed(RuntimeError):
    """A trial's deployment did not start or could not be measured; the message says why."""


@dataclass(frozen=True)
class TuneConfig:
    """What every trial replays: the same seeded workload at the same rate, scored by `slo`."""
    model: str
    rate: float
    slo: SLO
    num_requests: int = 20
    warmup: int = 2
    seed: int = 0
    workload: WorkloadSpec = WorkloadSpec()
    startup_timeout_s: float = 600.0
    bench_timeout_s: float = 600.0
    run_dir: str = ""
    ignore_eos: bool = False  # every request decodes its full output_tokens (as vllm bench serve --ignore-eos)
    evaluator: str = "live"   # live: real launches; sim: the discrete-event simulator on a profile
    sim_min_duration_s: float = SIM_MIN_DURATION_S  # a simulated trial's arrivals last at least this long

    def __post_init__(self) -> None:
        if self.evaluator not in EVALUATORS:
            raise ValueError(f"evaluator must be one of {EVALUATORS} (--evaluator), got {self.evaluator!r}")
        if not self.model:
            raise ValueError("model must be a checkpoint folder (--model DIR)")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be > 0 requests/s (--rate), got {self.rate}")
        if self.num_requests < 1 or self.warmup < 0:
            raise ValueError(f"--requests must be >= 1 and --warmup >= 0, got {self.num_requests}, {self.warmup}")
        if not (math.isfinite(self.sim_min_duration_s) and self.sim_min_duration_s >= 0):
            raise ValueError(f"--sim-min-duration-s must be >= 0 seconds, got {self.sim_min_duration_s}")
        if self.startup_timeout_s <= 0 or self.bench_timeout_s <= 0:
            raise ValueError("--startup-timeout and --bench-timeout must be > 0 seconds")

    @property
    def sim_requests(self) -> int:
        """Requests of a simulated trial: --requests, or --sim-min-duration-s of arrivals if more."""
        return steady_requests(self.rate, self.num_requests, self.sim_min_duration_s)

    def fingerprint(self, space: Space) -> dict:
        """What must not change between runs of one study (else goodputs are not comparable)."""
        return {"model": self.model, "rate": self.rate, "num_requests": self.num_requests, "seed": self.seed,
                "workload": json_safe(dataclasses.asdict(self.workload)), "slo": self.slo.to_dict(),
                "choices": list(space.choices), "batch_sizes": list(space.batch_sizes),
                "batch_modes": list(space.batch_modes),
                "devices": list(space.devices), "placements": list(space.placements), "ignore_eos": self.ignore_eos,
                **({"evaluator": self.evaluator} if self.evaluator != "live" else {}),  # old live studies resume
                **({"sim_requests": self.sim_requests} if self.evaluator == "sim" else {}),
                **({"tp": space.tp} if space.tp != 1 else {})}


def json_safe(v: Any) -> Any:
    """`v` with tuples as lists, non-finite floats as None and other leaves as strings."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


# ---- the study ---------------------------------------------------------------------------------
def open_study(storage: str, name: str, seed: int | None, fingerprint: Callable[[int], dict],
               warm: Sequence[dict] = ()):
    """Create or resume the study; returns (study, seed). A resumed study keeps its seed and
    must have been made with the same `fingerprint(seed)`; trials left RUNNING are failed.
    A new study enqueues the points `warm` (tune_space.warm_starts) as its first trials."""
    import optuna
    from optuna.samplers import TPESampler
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True, direction="maximize")
    stored = study.user_attrs.get("tune")
    new = stored is None
    if new:
        seed = 0 if seed is None else seed
        study.set_user_attr("tune", fingerprint(seed))
    else:
        if seed is not None and seed != stored["seed"]:
            raise ValueError(f"study {name!r} was made with --seed {stored['seed']}; drop --seed to resume it "
                             f"or pass a new --study")
        seed = stored["seed"]
        now = fingerprint(seed)
        diff = sorted(k for k in now if now[k] != stored.get(k))
        if diff:
            raise ValueError(f"study {name!r} was made with other settings ({', '.join(diff)}): "
                             f"{ {k: stored.get(k) for k in diff} }; use the same flags or a new --study")
    study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True, direction="maximize",
                                sampler=TPESampler(seed=seed))
    for params in warm if new else ():
        study.enqueue_trial(dict(params), user_attrs={"warm_start": True})
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # optuna has no public setter for a trial of an earlier process: its storage's
        study._storage.set_trial_user_attr(t._trial_id, "error", "left running by an earlier run that was killed")
        study.tell(t.number, state=TrialState.FAIL)
    return study, seed


def evaluate(d: Deployment, cfg: TuneConfig, run_dir: Path, on_up: Callable[[Any], None] = lambda s: None) -> dict:
    """Launch `d`, warm it up, bench it; the bench metrics. Always stops the stack."""
    import aiohttp

    from hasctl.bench import BenchConfig, run_bench
    from hasctl.launch import Stack, StageExited

    d = shared_partition_profiles(d, Path(cfg.run_dir).resolve() / "encode-profiles")
    stack = Stack(d, run_dir=run_dir, env={"EASERVE_TUNE_RUN": str(Path(cfg.run_dir).resolve())})
    try:
        try:
            stack.start(timeout=cfg.startup_timeout_s)
        except (StageExited, TimeoutError) as e:
            raise TrialFailed(f"did not start: {_clip(str(e))}") from None
        on_up(stack)
        url = stack.endpoints.http
        try:
            if cfg.warmup:
                asyncio.run(run_bench(BenchConfig(url=url, rate=cfg.rate, num_requests=cfg.warmup, seed=cfg.seed + 1,
                                                  workload=cfg.workload, timeout_s=cfg.bench_timeout_s,
                                                  ignore_eos=cfg.ignore_eos, progress=False)))
            result = asyncio.run(run_bench(BenchConfig(url=url, rate=cfg.rate, num_requests=cfg.num_requests,
                                                       seed=cfg.seed, workload=cfg.workload, slo=cfg.slo,
                                                       timeout_s=cfg.bench_timeout_s, label=d.name,
                                                       ignore_eos=cfg.ignore_eos, progress=False)))
        except (OSError, aiohttp.ClientError) as e:
            raise TrialFailed(f"bench could not reach the stack: {e!r}") from None
        restarts = {n: r for n, r in stack.restarts.items() if r}
        return {**result.metrics, "restarts": restarts, "max_send_lag_ms": result.max_send_lag_ms}
    finally:
        stop_uninterrupted(stack)


def shared_partition_profiles(d: Deployment, folder: Path) -> Deployment:
    """`d` with each co-located encode (and monolith) worker naming a partition-profile file in
    `folder`, one per (stage, device, threads, backend, policy, batch sizes): trials of one study
    (one model) measure each profile once instead of at every start (tens of seconds each)."""
    def named(stage: str, w):
        f = dict(w.flags)
        if (stage == "encode" and not f.get("colocate-prefill")) or f.get("partition-profile"):
            return w
        key = "-".join(str(x) for x in (stage, w.device, f.get("threads", 0), f.get("sm-backend", "auto"),
                                         f.get("partition-policy", "dynamic"), f.get("profile-batch-sizes", "")))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / ("".join(c if c.isalnum() or c in "-." else "_" for c in key) + ".json")
        return dataclasses.replace(w, flags={**f, "partition-profile": str(path)})
    return dataclasses.replace(d, encode=tuple(named("encode", w) for w in d.encode),
                               monolith=tuple(named("monolith", w) for w in d.monolith))


def stop_uninterrupted(stack) -> None:
    """`stack.stop()` with SIGINT and SIGTERM ignored meanwhile, so a second Ctrl-C cannot leave processes."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stack.stop()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _clip(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


Evaluate = Callable[[Deployment, int], dict]  # (deployment, trial number) -> metrics; raises TrialFailed


def evaluate_sim(d: Deployment, cfg: TuneConfig, profile) -> dict:
    """Score `d` in the simulator on the trial's workload (what `evaluate` measures live)."""
    from hasctl.bench import BenchConfig
    from hasctl.simulate import run_simulation
    bench = BenchConfig(url="http://simulated.invalid", rate=cfg.rate, num_requests=cfg.sim_requests, seed=cfg.seed,
                        workload=cfg.workload, slo=cfg.slo, ignore_eos=cfg.ignore_eos, label=d.name, progress=False)
    try:
        result, sim = run_simulation(d, profile, bench)
    except ValueError as e:
        raise TrialFailed(f"the simulator cannot run it: {e}") from None
    return {**result.metrics, "sim_seconds_per_wall_second": sim.speed}


def prescreen(space: Space, cfg: TuneConfig, profile, n_trials: int, keep: int, seed: int) -> list[tuple[dict, float]]:
    """Search `n_trials` points in the simulator (an in-memory TPE study); the `keep` distinct
    parameter sets of most simulated goodput, best first."""
    import optuna
    from optuna.samplers import TPESampler
    study = optuna.create_study(direction="maximize", sampler=TPESampler(seed=seed))
    for params in warm_starts(space):
        study.enqueue_trial(dict(params))
    sim_cfg = dataclasses.replace(cfg, evaluator="sim")
    run_trials(study, space, sim_cfg, n_trials, lambda d, _n: evaluate_sim(d, sim_cfg, profile), say=lambda _m: None)
    ranked, seen = [], set()
    for t in sorted((t for t in study.trials if t.value is not None), key=lambda t: (-t.value, t.number)):
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            ranked.append((dict(t.params), t.value))
    return ranked[:keep]


def run_trials(study, space: Space, cfg: TuneConfig, n_trials: int, evaluate_fn: Evaluate,
               say: Callable[[str], None] = print) -> None:
    """Ask, evaluate, tell `n_trials` times. KeyboardInterrupt: the trial is failed, its params
    queued for the next run, and the interrupt re-raised."""
    from optuna.trial import TrialState

    bar = _bar(n_trials)
    try:
        for _ in range(n_trials):
            trial = study.ask()
            params = suggest(trial, space)
            d = deployment_for(space, params, cfg.model, name=f"{study.study_name}-t{trial.number}")
            trial.set_user_attr("deployment", d.to_dict())
            trial.set_user_attr("evaluator", cfg.evaluator)
            say(f"trial {trial.number}: {_describe(params)}")
            try:
                metrics = evaluate_fn(d, trial.number)
            except TrialFailed as e:
                trial.set_user_attr("error", str(e))
                study.tell(trial, state=TrialState.FAIL)
                say(f"trial {trial.number}: failed: {str(e).splitlines()[0]}")
            except KeyboardInterrupt:
                trial.set_user_attr("error", INTERRUPTED)
                study.tell(trial, state=TrialState.FAIL)
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
                raise
            else:
                goodput = metrics.get("request_goodput") or 0.0
                trial.set_user_attr("metrics", json_safe(metrics))
                study.tell(trial, goodput)
                say(f"trial {trial.number}: goodput {goodput:.3f} req/s ({metrics.get('completed')} completed, "
                    f"{metrics.get('failed')} failed)")
            bar.update(1)
            best = best_trial(study)
            if best is not None:
                bar.set_postfix_str(f"best {best.value:.3f} req/s (trial {best.number})")
    finally:
        bar.close()


def _bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="tune", unit="trial", file=sys.stderr, dynamic_ncols=True)


def _describe(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def best_trial(study):
    """The complete trial of most goodput, or None."""
    from optuna.trial import TrialState
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(done, key=lambda t: (t.value, -t.number)) if done else None


def best_deployment(study) -> Deployment | None:
    """The best trial's deployment, the gateway back on its default ports (what `hasctl up` serves)."""
    t = best_trial(study)
    if t is None:
        return None
    d = Deployment.from_dict(t.user_attrs["deployment"])
    g = GatewaySpec()
    return dataclasses.replace(d, name=f"tuned-{study.study_name}-t{t.number}").with_gateway_ports(g.grpc_port,
                                                                                                    g.http_port)


# ---- command line ------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="search allocation x batch mode x B x s for the most goodput (Optuna TPE, real launches)")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--rate", type=float, required=True, help="arrival rate every trial replays, requests/s")
    p.add_argument("--trials", type=int, default=30, help="trials to run now (a resumed study adds these)")
    p.add_argument("--storage", required=True, help="optuna storage URL, e.g. sqlite:///tune.db")
    p.add_argument("--study", required=True, help="study name (resumed when it exists)")
    p.add_argument("--seed", type=int, default=None, help="sampler and workload seed (default 0; a resumed study's)")
    p.add_argument("--modality", default="image", choices=list(MODALITIES))
    p.add_argument("--requests", type=int, default=20, help="requests per trial's measured run")
    p.add_argument("--sim-min-duration-s", type=float, default=SIM_MIN_DURATION_S,
                   help="a simulated trial (--evaluator sim, --prescreen) replays at least this many seconds of "
                        "arrivals (rate x this many requests, when more than --requests): a short run at a high rate "
                        "is a burst that ends before the queues build, and scores a rate no deployment sustains")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before it (not scored)")
    p.add_argument("--image-size", default="224x224")
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--video-size", default="112x112")
    p.add_argument("--audio-s", type=float, default=2.0)
    p.add_argument("--input-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo", default=None, choices=["tight", "moderate", "loose"], help="tier from --profile")
    p.add_argument("--profile", default=None, help="profile file: SLO tiers, and screening of allocations")
    p.add_argument("--ttft-ms", type=float, default=None)
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--cores", default=None, help="CPU cores to place stages on, e.g. 0-3 or 0,2 "
                                                  "(default: the cores this process may use)")
    p.add_argument("--devices", default=None, help="devices instead of cores, e.g. cuda:0,cuda:1")
    p.add_argument("--instances", type=int, default=None,
                   help="most E+P+D instances per allocation (default: max(3, number of devices))")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="B values to try")
    p.add_argument("--batch-modes", default=",".join(BATCH_MODES),
                   help=f"encode batch modes to try, a subset of {','.join(BATCH_MODES)}")
    p.add_argument("--no-monolith", action="store_true", help="leave the monolith candidate out")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help="placements to try: split (instances round-robin over the devices), shared (all on all "
                        "of them; with several devices)")
    p.add_argument("--ignore-eos", action="store_true", help="every request decodes --output-tokens tokens")
    p.add_argument("--no-warm-start", action="store_true",
                   help="a new study starts with TPE's random draws only (default: the vLLM- and Dynamo-like "
                        "baselines', the screen's best and the presets' points first)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a trial's stack to serve")
    p.add_argument("--bench-timeout", type=float, default=600.0, help="seconds for a trial's bench")
    p.add_argument("--run-dir", default=None, help="folder of the trials' logs (default: a new temp folder)")
    p.add_argument("--out", default=None, help="write the best deployment here (.yaml / .json)")
    p.add_argument("--evaluator", default="live", choices=list(EVALUATORS),
                   help="how a trial is scored: live (launch and bench it) or sim (the simulator, on --profile)")
    p.add_argument("--prescreen", default=None, metavar="sim:K",
                   help="with --evaluator live: search --trials points in the simulator first, then measure only "
                        "the best K live (needs --profile)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"{what} must be comma-separated ints or ranges like 0-3, got {text!r}") from None
    return out


def space_from_args(args, say: Callable[[str], None] = print) -> Space:
    import os
    if args.devices and args.cores:
        raise ValueError("give --cores or --devices, not both")
    devices = (tuple(x.strip() for x in args.devices.split(",") if x.strip()) if args.devices
               else core_devices(_ints(args.cores, "--cores") if args.cores else sorted(os.sched_getaffinity(0))))
    instances = args.instances or max(3, len(devices))
    media = args.modality != "text"
    allocs = runnable_allocations(instances, media)
    seeds: dict = {}
    if args.profile:
        allocs, seeds = _screened(args, allocs, instances, media, say)
    else:
        say(f"no --profile: all {len(allocs)} allocations of 2..{instances} instances are tried (no screening)")
    batch = tuple(_ints(args.batch_sizes, "--batch-sizes"))
    places = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    modes = tuple(m.strip() for m in args.batch_modes.split(",") if m.strip())
    if len(devices) == 1:  # one device: shared is split
        places = places[:1]
    tp = _profile_tp(args.profile) if args.profile else 1
    return Space(tuple(allocs), devices, batch, monolith=not args.no_monolith, placements=places, batch_modes=modes,
                 tp=tp, **seeds)


def _profile_tp(path: str) -> int:
    """A tensor-parallel profile's tp: each tuned instance spans that many GPUs (--devices: each group's first)."""
    from hasctl.profile_format import load
    return load(path).tp


def _screened(args, allocs, instances: int, media: bool, say) -> tuple[list, dict]:
    from hasctl.profile_format import load
    from hasctl.screen import screen_candidates
    return screen_candidates(load(args.profile), args.rate, None if args.modality == "mixed" else args.modality,
                             allocs, instances, max(_ints(args.batch_sizes, "--batch-sizes")), say, args.profile)


def config_from_args(args, run_dir: str) -> TuneConfig:
    from hasctl.bench import slo_from_args
    slo = slo_from_args(args)
    if slo is None:
        raise ValueError("goodput needs an SLO: give --slo TIER --profile P or --ttft-ms and --tpot-ms")
    spec = WorkloadSpec(modality=args.modality, image_size=parse_size(args.image_size),
                        video_frames=args.video_frames, video_size=parse_size(args.video_size, "--video-size"),
                        audio_s=args.audio_s, input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    return TuneConfig(model=str(Path(args.model).resolve()), rate=args.rate, slo=slo, num_requests=args.requests,
                      warmup=args.warmup, seed=0 if args.seed is None else args.seed, workload=spec,
                      startup_timeout_s=args.startup_timeout, bench_timeout_s=args.bench_timeout, run_dir=run_dir,
                      ignore_eos=args.ignore_eos, evaluator=args.evaluator,
                      sim_min_duration_s=args.sim_min_duration_s)


def _prescreen_k(text: str | None) -> int | None:
    if text is None:
        return None
    kind, _, k = text.partition(":")
    if kind != "sim" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"--prescreen must be sim:K with K >= 1 (e.g. sim:3), got {text!r}")
    return int(k)


def run(args, evaluate_live: Callable[..., dict] = evaluate) -> int:
    """The command; `evaluate_live` (`evaluate`'s signature) measures a trial live: the seam a
    test uses to see which deployments would be launched, without launching them."""
    if args.trials < 1:
        raise ValueError(f"--trials must be >= 1, got {args.trials}")
    keep = _prescreen_k(args.prescreen)
    if keep is not None and args.evaluator != "live":
        raise ValueError("--prescreen ranks candidates for live measurement; use it with --evaluator live")
    if (keep is not None or args.evaluator == "sim") and not args.profile:
        raise ValueError("the simulator needs --profile PROFILE.json (its service times)")
    profile = None
    if args.profile and (keep is not None or args.evaluator == "sim"):
        from hasctl.profile_format import load
        profile = load(args.profile)
    space = space_from_args(args)
    if space.tp > 1 and args.evaluator == "live":
        raise ValueError(f"{args.profile} is a tp={space.tp} profile: its instances span {space.tp} GPUs, which the "
                         f"stage processes cannot run; tune it with --evaluator sim (without --prescreen)")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"easerve-tune-{args.study}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_from_args(args, str(run_dir))
    study, seed = open_study(args.storage, args.study, args.seed,
                             lambda s: dataclasses.replace(cfg, seed=s).fingerprint(space),
                             warm=() if args.no_warm_start or keep is not None else warm_starts(space))
    cfg = dataclasses.replace(cfg, seed=seed)
    from optuna.trial import TrialState
    queued = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    print(f"study {args.study!r} in {args.storage}: {len(study.trials) - queued} trials so far "
          f"({queued} queued), seed {seed}; "
          f"candidates {list(space.choices)} on {list(space.devices)}; logs in {run_dir}", flush=True)

    def say(msg: str) -> None:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()

    def one(d: Deployment, number: int) -> dict:
        if cfg.evaluator == "sim":
            return evaluate_sim(d, cfg, profile)
        return evaluate_live(d, cfg, run_dir / f"trial-{number}",
                             on_up=lambda st: say(f"trial {number}: up, gateway {st.endpoints.http}"))

    n_trials = args.trials
    if keep is not None:
        ranked = prescreen(space, cfg, profile, args.trials, keep, seed)
        for params, value in ranked:
            study.enqueue_trial(params, user_attrs={"prescreen_sim_goodput": value})
            print(f"prescreen (sim): goodput {value:.3f} req/s for {_describe(params)}", flush=True)
        n_trials = len(ranked)

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down like Ctrl-C
    try:
        run_trials(study, space, cfg, n_trials, one, say)
    except KeyboardInterrupt:
        print(f"interrupted: the stack is stopped; rerun the same command to continue study {args.study!r}",
              file=sys.stderr, flush=True)
        _write_best(study, args.out)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if _write_best(study, args.out) else 1


def _write_best(study, out: str | None) -> bool:
    best, d = best_trial(study), best_deployment(study)
    if d is None:
        print("no trial completed; nothing to write", file=sys.stderr, flush=True)
        return False
    print(f"best: trial {best.number}, goodput {best.value:.3f} req/s, {_describe(best.params)}", flush=True)
    if out:
        print(f"wrote {d.dump(out)} (serve it with: hasctl up --deployment {out})", flush=True)
    print(json.dumps({"best_trial": best.number, "request_goodput": best.value, "params": best.params}), flush=True)
    return True
