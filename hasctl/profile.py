"""`hasctl profile`: measure each stage alone, in this process, and write a profile file (the
measurements: hasctl.profile_measure; the operating points: hasctl.profile_plan).

On one device (the first of --devices; the rest are recorded as alike) or one core group
(--cores), with the real adapters (`load_adapter` roles "encode" and "decode"; prefill runs on
the decode role's LM, as in `easerve.pipeline`):
- encode: `adapter.encode` over batch sizes x share levels on the reference media of the
  model's first modality, under the partition backend `easerve.partition.backends` picks
  (green contexts on CUDA, core affinity on CPU), by `easerve.stages.encode.profiler` (the
  profiler a co-located encode worker runs at start-up); where that backend cannot split
  (MPS, time slicing, one core) only share 1.0 is measured and `encode.backend_note` says so.
  Then each modality's media sizes at share 1.0.
- prefill: `adapter.prefill` of text-only prompts over prompt lengths x batch sizes.
- decode: `DecodeEngine.step` with 1..N running requests, at a few context lengths.
- unloaded TTFT / TPOT per modality (and text): one request alone through preprocess ->
  encode -> prefill -> first token (TTFT), then the engine until `--output-tokens` (TPOT).
- SLO tiers: multiples (--tiers, default 2,4,8) of those unloaded latencies.
- revision 2 and 4: the gateway's preprocessing per media size, transfer sizes and link
  speeds, the in-process interference of encode and prefill, and on CPU cores the sharing
  curve: each stage alone and while 1 .. `sharing_busy` other processes compute on the same
  cores (hasctl/profile_sharing.py); revision 6: each stage alone in the shared-cores
  environment over alone here.
Every cell is the median of --repeats timed calls after one warm-up call
(`profiler.time_call`: the clock is read after CUDA work is synchronized). `--quick`: a few small points, one repeat (tests).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from easerve import profile_format as pf
from easerve.stages.encode import profiler as ep
from hasctl import roofline_profile
from hasctl.profile_measure import Profiler
from hasctl.profile_plan import QUICK, Plan, parse_tiers, sizes_of
from hasctl.profile_sharing import measure_sharing


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-3' / '0,2,4-5' -> core ids."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"--cores takes core ids like 0-3 or 0,2,4-5, got {text!r}") from None
    if not out:
        raise ValueError(f"--cores names no core: {text!r}")
    return tuple(sorted(set(out)))


def run_profile(model: str, device: str, devices: tuple[str, ...], plan: Plan,
                multipliers: dict[str, float] | None = None, progress: bool = True, quick: bool = False) -> pf.Profile:
    """Measure everything on `device` and return the profile (see the module docstring)."""
    from tqdm import tqdm
    n_enc = len(plan.encode_batches) * len(plan.shares)  # an upper bound when shares collapse to 1.0
    bar = tqdm(total=None, desc="profile", unit="point", file=sys.stderr, disable=not progress, dynamic_ncols=True)

    def tick(what: str) -> None:
        bar.set_postfix_str(what, refresh=False)
        bar.update(1)

    try:
        prof = Profiler(model, device.split(":", 1)[0] if device.startswith("cpu") else device, plan, tick)
        sizes = sum(len(sizes_of(plan, m)) for m in prof.modalities) * len(plan.size_batches)
        bar.total = (n_enc + sizes + len(plan.prompt_lens) * len(plan.prefill_batches)
                     + len(plan.decode_batches) * len(plan.decode_contexts)
                     + len(prof.modalities) + 1 + (1 if prof.modalities else 0)  # + interference
                     + (0 if device.startswith("cuda") else plan.sharing_busy * (3 if prof.modalities else 2)))
        encode = prof.measure_encode() if prof.modalities else None
        prefill, decode, unloaded = prof.measure_prefill(), prof.measure_decode(), prof.measure_unloaded()
        gateway, transfer, interference = prof.measure_gateway(), prof.measure_transfer(), prof.measure_interference()
        import torch
        sharing, shared_env = measure_sharing(prof, torch.get_num_threads(), len(os.sched_getaffinity(0)),
                                              plan.sharing_busy, quick)
    finally:
        bar.close()
    return pf.Profile(ep.hardware(device, devices), ep.versions(), ep.model_info(model, prof.modalities), encode,
                      tuple(prefill), tuple(decode), tuple(unloaded), pf.tiers_from(unloaded, multipliers),
                      ep.utc_now(), quick, revision=pf.REVISION,
                      gateway=tuple(gateway), transfer=transfer, interference=tuple(interference),
                      sharing=tuple(sharing), shared_env=tuple(shared_env))


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure each stage's capacity alone and write a profile file")
    p.add_argument("--model", required=True, help="checkpoint folder or hub id ORG/NAME[@REVISION] (the roofline: "
                   "only its config is fetched)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--devices", default=None, help="GPUs, e.g. cuda:0,cuda:1 (measured on the first)")
    where.add_argument("--cores", default=None, help="CPU core group, e.g. 0-1 (default: every allowed core)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the group's core count)")
    p.add_argument("--tiers", default="2,4,8", help="SLO multipliers of the unloaded latency: tight,moderate,loose")
    p.add_argument("--quick", action="store_true", help="a few small points, one repeat (tests, smoke runs)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (median)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--host-work", default=None, metavar="OUT",
                   help="also measure the stack's host CPU per request per stage process (default and monolith "
                        "stacks on --host-work-model, hasctl/profile_host.py) into OUT, for hasctl simulate / tune "
                        "--host-work")
    p.add_argument("--host-work-model", default=None, metavar="DIR",
                   help="checkpoint the host work is measured on (default: the tiny checkpoint of the model's "
                        "family, whose compute is negligible)")
    p.add_argument("--roofline", action="store_true",
                   help="compute the profile from the model's config and --gpu's spec instead of measuring (measured: false)")
    p.add_argument("--gpu", default=None, help="with --roofline: a shipped device spec name or a SPEC.json "
                   "(easerve/roofline/specs: a100-80g, h100-sxm, h200, l40s, rtx6000-ada, cpu-epyc-2c)")
    p.add_argument("--tp", type=int, default=1, help="with --roofline: devices per instance (tensor parallel)")
    p.add_argument("--network-gbps", type=float, default=None,
                   help="with --roofline: the network between nodes, Gb/s (the simulator's cross-node link)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.roofline or args.gpu:
        if not (args.roofline and args.gpu):
            raise ValueError("--roofline and --gpu go together: hasctl profile --roofline --gpu NAME|SPEC.json --model DIR")
        return roofline_profile.run(args)
    if args.tp != 1 or args.network_gbps is not None:
        raise ValueError("--tp and --network-gbps are for --roofline profiles; a measured profile runs on one device")
    import torch
    multipliers = parse_tiers(args.tiers)
    if args.devices:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
        if not all(d.startswith("cuda") for d in devices):
            raise ValueError(f"--devices takes GPUs (cuda:0,cuda:1); for CPU cores use --cores, got {args.devices!r}")
        if not torch.cuda.is_available():
            raise ValueError("--devices asks for GPUs but CUDA is not available here; use --cores")
        device, cores = devices[0], None
    else:
        cores = parse_cores(args.cores) if args.cores else tuple(sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, cores)
        device = f"cpu:{_core_text(cores)}"
        devices = (device,)
    torch.set_num_threads(args.threads or (len(cores) if cores else torch.get_num_threads()))
    plan = QUICK if args.quick else Plan()
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    from easerve.models.hub import resolve_model
    model = str(resolve_model(args.model, ("encode", "decode")))
    prof = run_profile(model, device, devices, plan, multipliers, not args.no_progress, args.quick)
    pf.dump(prof, args.out)
    enc = prof.encode
    print(f"wrote {args.out}: {prof.model.family} on {device}"
          + (f"; encode {enc.backend} ({len(enc.shares)} share levels)" if enc else ""))
    for u in prof.unloaded:
        print(f"  unloaded {u.modality:<5} TTFT {u.ttft_s * 1e3:.1f} ms  TPOT {u.tpot_s * 1e3:.2f} ms")
    if args.host_work:
        from hasctl import profile_host
        profile_host.run_cli(args, prof)
    return 0


def _core_text(cores: tuple[int, ...]) -> str:
    if cores == tuple(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))
