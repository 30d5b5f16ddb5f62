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

import dataclasses
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable

from easerve.models.hub import canonical
from easerve.policy.batcher import MODES as BATCH_MODES
from hasctl.deployment import Deployment
from hasctl.trials import (EVALUATORS, SIM_MIN_DURATION_S, TuneConfig, best_deployment, best_trial, describe, evaluate,
                           evaluate_sim, open_study, prescreen, run_trials)
from hasctl.tune_space import BATCH_SIZES, PLACEMENTS, Space, core_devices, runnable_allocations, warm_starts
from hasctl.workload import MODALITIES, WorkloadSpec, parse_size

# ---- command line ------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="search allocation x batch mode x B x s for the most goodput (Optuna TPE, real launches)")
    p.add_argument("--model", required=True, help="checkpoint folder or hub id ORG/NAME[@REVISION]")
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
    p.add_argument("--host-work", default=None, metavar="FILE",
                   help="with --evaluator sim: host CPU per request per stage (hasctl profile --host-work)")
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
    from easerve.profile_format import load
    return load(path).tp


def _screened(args, allocs, instances: int, media: bool, say) -> tuple[list, dict]:
    from easerve.profile_format import load
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
    return TuneConfig(model=canonical(args.model), rate=args.rate, slo=slo, num_requests=args.requests,
                      warmup=args.warmup, seed=0 if args.seed is None else args.seed, workload=spec,
                      startup_timeout_s=args.startup_timeout, bench_timeout_s=args.bench_timeout, run_dir=run_dir,
                      ignore_eos=args.ignore_eos, evaluator=args.evaluator,
                      sim_min_duration_s=args.sim_min_duration_s, host_work=args.host_work or "")


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
        from easerve.profile_format import load
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
            print(f"prescreen (sim): goodput {value:.3f} req/s for {describe(params)}", flush=True)
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
    print(f"best: trial {best.number}, goodput {best.value:.3f} req/s, {describe(best.params)}", flush=True)
    if out:
        print(f"wrote {d.dump(out)} (serve it with: hasctl up --deployment {out})", flush=True)
    print(json.dumps({"best_trial": best.number, "request_goodput": best.value, "params": best.params}), flush=True)
    return True
