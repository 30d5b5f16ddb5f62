"""The trials of `hasctl tune`: what every trial replays (`TuneConfig`), the study that keeps
them, one deployment scored live (`evaluate`: launched, warmed up, benched, stopped) or in the
simulator (`evaluate_sim`), the search loop (`run_trials`) and the best trial's deployment.
The command line, its flags and `run` are in hasctl/tune.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from easerve.slo import SLO
from hasctl.deployment import Deployment, GatewaySpec
from hasctl.tune_space import Space, deployment_for, suggest, warm_starts
from hasctl.workload import WorkloadSpec, steady_requests

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
    host_work: str = ""       # sim: a host-work file (hasctl profile --host-work) charged as core time

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
    model = None
    if cfg.host_work:
        from easerve.policy.service_model import ModelConfig
        from hasctl import profile_host
        model = ModelConfig(host_s=profile_host.host_s_for(profile_host.load(cfg.host_work), d, profile,
                                                           cfg.workload.modality))
    try:
        result, sim = run_simulation(d, profile, bench, model)
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
            say(f"trial {trial.number}: {describe(params)}")
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


def describe(params: dict) -> str:
    """A trial's parameters on one line."""
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
