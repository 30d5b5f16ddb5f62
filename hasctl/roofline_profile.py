"""`hasctl profile --roofline`: an `easerve.profile/v1` file computed from the model's config and a
device spec (easerve.roofline), not measured: `measured: false`, revision 3, with a `roofline`
block naming the spec, its source and the efficiency factors applied.

The points are those of a plan (hasctl.profile_plan.Plan; `ROOFLINE_PLAN` by default, sized for
GPUs and full-size models), each the roofline seconds of that call (see easerve/roofline/spec.py).
The unloaded request of each modality is encode (batch 1) + prefill of its prompt (the media's rows
+ TEXT_TOKENS) for TTFT, one decode step at that context for TPOT; the gateway's preprocessing is
not modelled (no `gateway` points: 0 s). The KV budget of a decode (or monolith) device is stated
in the `roofline` block (`kv_gib_per_device`: easerve.roofline.models.kv_budget_gib; the
simulator sizes its decode caches by it).

Interference is stated, from the roofline's own times, not measured (`interference`): busy
stages that share a GPU without an SM partition slow each other (a partitioned co-located
encode + prefill runs at its shares instead: easerve/sim/stages.py), else the simulator would
let one GPU run three stages at full speed at once:
- decode with prefill: they meet only in one engine (the monolith, vLLM-like), whose chunked
  prefill runs a chunk of CHUNK_TOKENS in the same step as the decode tokens, so a decode step
  takes the chunk's time too: slowdown 1 + chunk / step, and prefill 1 + step / chunk, the step
  at DECODE_REF_BATCH requests of the reference request's context;
- decode with encode: the same engine runs the tower inside its step, before the LM's forward
  (as vLLM v1's model runner does), so a decode step takes the encode call's time too:
  1 + encode / step, and encode 1 + step / encode, the encode call the reference request's alone
  (with the spec's `encode_call_overhead_s`);
- every other pair (encode with prefill, a stage with itself: two processes or streams on one
  GPU) time-slices it: TIMESLICE_SLOWDOWN, each at about half speed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from easerve.roofline import DeviceSpec, ModelArch, load_arch, load_spec
from easerve.roofline.models import check_fits, kv_budget_gib
from easerve.stages.encode.profiler import media_label, utc_now
from easerve import profile_format as pf
from hasctl.profile_plan import QUICK, Plan, parse_tiers, reference_size, sizes_of

ROOFLINE_PLAN = Plan(image_sizes=((336, 336), (672, 672), (1024, 768)),
                     video_sizes=((8, 448, 448), (16, 448, 448), (32, 448, 448)),
                     audio_seconds=(5.0, 10.0, 30.0), size_batches=(1, 4),
                     prompt_lens=(256, 1024, 4096), prefill_batches=(1, 4),
                     decode_batches=(1, 8, 32, 128), decode_contexts=(512, 2048), output_tokens=128, repeats=1)
TEXT_TOKENS = 48  # the unloaded request's text and chat template, as hasctl profile's (32 words + template)
TIMESLICE_SLOWDOWN = 2.0  # stated: two busy contexts time-slicing one GPU each run at about half speed
CHUNK_TOKENS = 2048       # a monolith's prefill chunk: the engines' max_batched_tokens default (vLLM's too)
DECODE_REF_BATCH = 16     # the decode step the chunk is weighed against: a moderately loaded instance
NETWORK_LATENCY_S = 20e-6  # stated: one cross-node message (RDMA-class NICs: a few us; TCP: tens)


class RooflineModel:
    """Seconds of each call of `arch` on `spec`, `tp` devices per instance."""

    def __init__(self, arch: ModelArch, spec: DeviceSpec, tp: int = 1):
        if tp < 1:
            raise ValueError(f"--tp must be >= 1, got {tp}")
        check_fits(arch, spec.mem_gib, tp, spec.dtype_bytes)
        self.arch, self.spec, self.tp, self.b = arch, spec, tp, spec.dtype_bytes

    def encode_s(self, modality: str, media: str, batch: int, share: float = 1.0) -> float:
        """One encode call of `batch` items: the tower's roofline and, once per call, the stack's
        fixed cost (`efficiency.encode_call_overhead_s`)."""
        tower = self.spec.seconds(self.arch.encode_cost(modality, [media] * batch, self.b), share, self.tp)
        return tower + self.spec.efficiency.encode_call_overhead_s

    def prefill_s(self, prompt_len: int, batch: int) -> float:
        return self.spec.seconds(self.arch.lm.prefill_cost([prompt_len] * batch, self.b), 1.0, self.tp)

    def decode_s(self, batch: int, context: int) -> float:
        return self.spec.seconds(self.arch.lm.decode_cost([context] * batch, self.b), 1.0, self.tp)


def build(model_dir: str, spec: DeviceSpec, tp: int = 1, plan: Plan = ROOFLINE_PLAN,
          multipliers: dict[str, float] | None = None, network_gbps: float | None = None) -> pf.Profile:
    """`network_gbps`: the nodes' network (Gb/s per instance), written as the `other_host` link
    (stated, not measured; without it the simulator moves data between nodes for free)."""
    if network_gbps is not None and not network_gbps > 0:
        raise ValueError(f"--network-gbps must be > 0 (Gb/s between nodes), got {network_gbps}")
    arch = load_arch(model_dir)
    rm = RooflineModel(arch, spec, tp)
    mods = arch.modalities
    ref = mods[0]
    ref_media = media_label(ref, reference_size(plan, ref))
    grid = tuple(pf.EncodePoint(b, s, rm.encode_s(ref, ref_media, b, s)) for b in plan.encode_batches for s in plan.shares)
    by_size = tuple(pf.EncodeSizePoint(m, lab, arch.rows(m, lab), b, rm.encode_s(m, lab, b))
                    for m in mods for lab in (media_label(m, x) for x in sizes_of(plan, m)) for b in plan.size_batches)
    encode = pf.EncodeProfile("roofline", f"derived: SM share scales compute (memory bandwidth saturates at half "
                              f"the SMs), {spec.name}", ref, ref_media, grid, by_size)
    limit = int(arch.cfg["text_config"].get("max_position_embeddings", 1 << 20))
    prefill = tuple(pf.PrefillPoint(n, b, rm.prefill_s(n, b)) for n in sorted({min(n, limit) for n in plan.prompt_lens})
                    for b in plan.prefill_batches)
    decode = tuple(pf.DecodePoint(b, rm.decode_s(b, c), c) for c in plan.decode_contexts for b in plan.decode_batches)
    unloaded = []
    for m in mods + ("text",):
        media = "" if m == "text" else media_label(m, reference_size(plan, m))
        n = TEXT_TOKENS + (arch.rows(m, media) if media else 0)
        ttft = (rm.encode_s(m, media, 1) if media else 0.0) + rm.prefill_s(n, 1)
        unloaded.append(pf.Unloaded(m, media, n, plan.output_tokens, ttft, rm.decode_s(1, n)))
    ref_n = unloaded[0].prompt_tokens  # the reference modality's request
    e = spec.efficiency
    own = spec.mem_gb_per_s * e.memory
    transfer = pf.Transfer(arch.lm.block.hidden * spec.dtype_bytes, arch.lm.kv_bytes_per_token(spec.dtype_bytes),
                           (pf.LinkPoint("same_device", own, 0.0, measured=False),
                            pf.LinkPoint("same_host", spec.interconnect_gb_per_s, 1e-5, measured=False),
                            *([pf.LinkPoint("other_host", network_gbps / 8, NETWORK_LATENCY_S, measured=False)]
                              if network_gbps else [])))
    info = pf.Roofline(spec.name, spec.source, spec.dtype, spec.tflops, spec.mem_gb_per_s, spec.interconnect_gb_per_s,
                       e.compute, e.memory, e.layer_overhead_s, e.call_overhead_s,
                       round(kv_budget_gib(arch, spec.mem_gib, tp, spec.dtype_bytes), 3), e.encode_call_overhead_s)
    hw = pf.Hardware(f"roofline {spec.name} (not measured)", 1, (spec.name,) * tp, f"{spec.name}:0",
                     tuple(f"{spec.name}:{i}" for i in range(tp)))
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    model = pf.ModelInfo(str(Path(model_dir).resolve()), arch.family, digest, mods)
    versions = pf.Versions(_version(), "n/a (roofline)", "n/a (roofline)", "n/a (roofline)")
    return pf.Profile(hw, versions, model, encode, prefill, decode, tuple(unloaded),
                      pf.tiers_from(unloaded, multipliers), utc_now(), False, revision=pf.ROOFLINE_REVISION,
                      transfer=transfer, measured=False, tp=tp, roofline=info,
                      interference=interference(rm.prefill_s(CHUNK_TOKENS, 1), rm.decode_s(DECODE_REF_BATCH, ref_n),
                                                rm.encode_s(ref, ref_media, 1)))


def interference(chunk_s: float, step_s: float, encode_s: float) -> tuple[pf.Interference, ...]:
    """Every ordered pair of GPU stages (see the module docstring): a prefill chunk of `chunk_s`
    and an encode call of `encode_s` each serialized with a decode step of `step_s`, the other
    pairs time-sliced."""
    stages = ("encode", "prefill", "decode")
    engine = {("decode", "prefill"): 1 + chunk_s / step_s, ("prefill", "decode"): 1 + step_s / chunk_s,
              ("decode", "encode"): 1 + encode_s / step_s, ("encode", "decode"): 1 + step_s / encode_s}
    return tuple(pf.Interference(a, b, round(engine.get((a, b), TIMESLICE_SLOWDOWN), 4)) for a in stages for b in stages)


def _version() -> str:
    import importlib.metadata as md
    try:
        return md.version("easerve")
    except md.PackageNotFoundError:
        return "unknown (not installed)"


def run(args) -> int:
    spec = load_spec(args.gpu)
    from easerve.models.hub import resolve_model
    prof = build(str(resolve_model(args.model, ("processor",))), spec, args.tp, QUICK if args.quick else ROOFLINE_PLAN, parse_tiers(args.tiers),
                 args.network_gbps)
    pf.dump(prof, args.out)
    print(f"wrote {args.out}: roofline of {prof.model.family} on {spec.name} x tp={args.tp} (measured: false)")
    for u in prof.unloaded:
        print(f"  unloaded {u.modality:<5} {u.media or '-':>12} TTFT {u.ttft_s * 1e3:.1f} ms  TPOT {u.tpot_s * 1e3:.2f} ms")
    return 0

