"""`hasctl profile`: measure each stage alone, in this process, and write a profile file.

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
  cores (hasctl/profile_sharing.py).
Every cell is the median of --repeats timed calls after one warm-up call
(`profiler.time_call`: the clock is read after CUDA work is synchronized). `--quick`: a few small points, one repeat (tests).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

from easerve.engine.detok import prompt_tail
from easerve.stages.encode import profiler as ep
from easerve import profile_format as pf


@dataclass(frozen=True)
class Plan:
    """The operating points to measure."""
    encode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    shares: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    image_sizes: tuple[tuple[int, int], ...] = ((112, 112), (224, 224), (448, 448))
    video_sizes: tuple[tuple[int, int, int], ...] = ((4, 112, 112), (8, 112, 112), (16, 112, 112))
    audio_seconds: tuple[float, ...] = (1.0, 2.0, 5.0)
    size_batches: tuple[int, ...] = (1, 4)
    prompt_lens: tuple[int, ...] = (64, 256, 1024)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 8
    output_tokens: int = 32
    repeats: int = 3
    sharing_busy: int = 3         # CPU: up to this many neighbour processes (hasctl/profile_sharing.py); 0: none

    def __post_init__(self) -> None:
        for name in ("encode_batches", "size_batches", "prompt_lens", "prefill_batches", "decode_batches",
                     "decode_contexts"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v):
                raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {v}")
        if self.repeats < 1 or self.decode_steps < 1 or self.output_tokens < 2 or self.sharing_busy < 0:
            raise ValueError("repeats and decode_steps must be >= 1, output_tokens >= 2, sharing_busy >= 0")


QUICK = Plan(encode_batches=(1, 2), shares=(0.5, 1.0), image_sizes=((56, 56),), video_sizes=((2, 56, 56),),
             audio_seconds=(0.5,), size_batches=(1,), prompt_lens=(16, 48), prefill_batches=(1, 2),
             decode_batches=(1, 4), decode_contexts=(32,), decode_steps=2, output_tokens=4, repeats=1, sharing_busy=1)


def sizes_of(plan: Plan, modality: str) -> tuple:
    return {"image": plan.image_sizes, "video": plan.video_sizes, "audio": plan.audio_seconds}[modality]


def reference_size(plan: Plan, modality: str):
    """The media size of the encode grid and the unloaded request: the second size if there is one."""
    sizes = sizes_of(plan, modality)
    return sizes[min(1, len(sizes) - 1)]


class Profiler:
    """Holds the adapters and a timer; each `measure_*` returns profile_format points."""

    def __init__(self, model: str, device: str, plan: Plan, tick: Callable[[str], None] = lambda _s: None):
        from easerve.models.registry import load_adapter
        self.model, self.device, self.plan, self.tick = model, device, plan, tick
        self.enc = load_adapter(model, role="encode", device=device)
        self.lm = load_adapter(model, role="decode", device=device)
        self.modalities = tuple(self.enc.modalities)
        self.sync = ep.device_sync(device)

    def _time(self, fn: Callable[[], object]) -> float:
        return ep.time_call(fn, self.plan.repeats, sync=self.sync)

    def _item(self, modality: str, size):
        return ep.synthetic_item(self.enc, modality, size)

    # ---- encode -------------------------------------------------------------------------------
    def measure_encode(self) -> pf.EncodeProfile:
        from easerve.partition.backends import select_backend
        plan, ref = self.plan, self.modalities[0]
        backend = select_backend("auto", self.device, plan.shares)
        try:
            grid = ep.measure_encode(self.enc, backend, plan.encode_batches, media=reference_size(plan, ref),
                                     repeats=plan.repeats, sync=self.sync, tick=self.tick)
        finally:
            backend.close()
        by_size = [self._size_point(m, s, b) for m in self.modalities for s in sizes_of(plan, m)
                   for b in plan.size_batches]
        return dataclasses.replace(grid, by_size=tuple(by_size))

    def _size_point(self, modality: str, size, batch: int) -> pf.EncodeSizePoint:
        item = self._item(modality, size)
        lat = self._time(lambda: self.enc.encode([item] * batch))
        self.tick(f"encode {modality} {ep.media_label(modality, size)} b={batch}")
        return pf.EncodeSizePoint(modality, ep.media_label(modality, size), int(item.num_tokens), batch, lat)

    # ---- prefill / decode ------------------------------------------------------------------------
    def _prompt(self, n: int, seed: int) -> list[int]:
        import numpy as np
        avoid = set(getattr(self.lm, "placeholder_ids", {}).values()) | set(self.lm.eos_token_ids)
        rng = np.random.default_rng(seed)
        ids = [int(t) for t in rng.integers(10, self.lm.text_config.vocab_size, 2 * n + 16) if int(t) not in avoid]
        return ids[:n]

    def _prefill_reqs(self, n: int, batch: int, max_tokens: int = 16):
        from easerve.types import PrefillRequest, SamplingParams
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return [PrefillRequest(f"p{i}", self._prompt(n, i), [], [], sp) for i in range(batch)]

    def measure_prefill(self) -> list[pf.PrefillPoint]:
        out = []
        limit = int(getattr(self.lm.text_config, "max_position_embeddings", 1 << 20)) - 64
        for n in (min(n, limit) for n in self.plan.prompt_lens):
            for b in self.plan.prefill_batches:
                reqs = self._prefill_reqs(n, b)
                out.append(pf.PrefillPoint(n, b, self._time(lambda: self.lm.prefill(reqs))))
                self.tick(f"prefill len={n} b={b}")
        return out

    def _engine(self, batch: int, tokens_per_req: int):
        from easerve.engine.config import EngineConfig
        from easerve.engine.engine import DecodeEngine
        blocks = -(-tokens_per_req // 16) + 1
        return DecodeEngine(self.lm, EngineConfig(max_running=batch, max_waiting=batch,
                                                  kv_capacity_tokens=batch * blocks * 16, device=self.device))

    def measure_decode(self) -> list[pf.DecodePoint]:
        return [self._decode_point(b, ctx) for ctx in self.plan.decode_contexts for b in self.plan.decode_batches]

    def _decode_point(self, batch: int, ctx: int) -> pf.DecodePoint:
        """`batch` requests with `ctx` prompt tokens of KV each (one prefill, its KV shared), all
        admitted by the first step; then the timed steps (the batch stays full throughout)."""
        from easerve.types import KVPayload
        plan = self.plan
        [req] = self._prefill_reqs(ctx, 1, max_tokens=8 + plan.decode_steps * (plan.repeats + 1))
        res = self.lm.prefill([req])[0]
        engine = self._engine(batch, ctx + req.sampling.max_tokens)
        for i in range(batch):
            engine.add(KVPayload(f"d{i}", res.keys, res.values, res.prompt_len, res.rope_delta, 11,
                                 req.sampling, prompt_tail(req.input_ids)))
        engine.step()
        running = engine.stats().running
        if running != batch:
            raise RuntimeError(f"decode batch {batch}: only {running} requests admitted; the KV sizing is off")
        step = self._time(lambda: [engine.step() for _ in range(plan.decode_steps)]) / plan.decode_steps
        self.tick(f"decode b={batch} ctx={ctx}")
        return pf.DecodePoint(batch, step, ctx)

    # ---- unloaded single request ------------------------------------------------------------------
    def measure_unloaded(self) -> list[pf.Unloaded]:
        out = []
        for mod in self.modalities + ("text",):
            size = None if mod == "text" else reference_size(self.plan, mod)
            runs = [self._one_request(mod, size, seed) for seed in range(self.plan.repeats + 1)][1:]  # 1st: warm-up
            ttft = statistics.median(r[0] for r in runs)
            tpot = statistics.median(r[1] for r in runs)
            out.append(pf.Unloaded(mod, "" if size is None else ep.media_label(mod, size), runs[0][2],
                                   self.plan.output_tokens, ttft, tpot))
            self.tick(f"unloaded {mod}")
        return out

    def _one_request(self, modality: str, size, seed: int) -> tuple[float, float, int]:
        from easerve.engine.sampler import sample
        from easerve.types import KVPayload, PrefillRequest, SamplingParams, items_meta
        from hasctl.workload import text_of
        n_out = self.plan.output_tokens
        sp = SamplingParams(max_tokens=n_out, ignore_eos=True)
        content = ([] if size is None else [ep.synthetic_part(modality, size, seed)]) + [
            {"type": "text", "text": text_of(32, seed)}]
        engine = self._engine(1, 16384)
        t0 = time.perf_counter()
        prompt = self.enc.preprocess([{"role": "user", "content": content}])
        embeds = self.enc.encode(prompt.items) if prompt.items else []
        req = PrefillRequest("u", prompt.input_ids, embeds, items_meta(prompt.items), sp)
        res = self.lm.prefill([req])[0]
        first = sample(res.last_logits[None], [sp], [0])[0]
        self.sync()
        t_first = time.perf_counter()
        engine.add(KVPayload("u", res.keys, res.values, res.prompt_len, res.rope_delta, first, sp,
                             prompt_tail(prompt.input_ids)))
        t_last, seen = t_first, 1
        while engine.has_work:
            outs = [o for o in engine.step() if o.token_id is not None and o.index >= 1]
            self.sync()
            if outs:
                t_last, seen = time.perf_counter(), seen + len(outs)
        if seen != n_out:
            raise RuntimeError(f"unloaded {modality}: {seen} tokens, expected {n_out}")
        return t_first - t0, (t_last - t_first) / (n_out - 1), len(prompt.input_ids)


    # ---- revision 2: gateway preprocessing, transfers, interference ------------------------------
    def measure_gateway(self) -> list[pf.GatewayPoint]:
        """The encode adapter's preprocess (chat template, tokenizer, HF processor) of one request
        per media size, and of a text-only one: what the gateway spends per request."""
        from hasctl.workload import text_of
        out = []
        for mod in self.modalities + ("text",):
            for size in (None,) if mod == "text" else sizes_of(self.plan, mod):
                content = ([] if size is None else [ep.synthetic_part(mod, size, 0)]) + [{"type": "text", "text": text_of(32, 0)}]
                msgs = [{"role": "user", "content": content}]
                out.append(pf.GatewayPoint(mod, "" if size is None else ep.media_label(mod, size),
                                           self._time(lambda m=msgs: self.enc.preprocess(m))))
        return out

    def measure_transfer(self) -> pf.Transfer:
        """Bytes per token from the model's config and dtype; same_host: a plain memory copy of
        64 MiB (what shared memory costs); same_device: a device-to-device copy on CUDA, the same
        memory copy on CPU. other_host is not measurable on one machine and is left out."""
        import torch
        from easerve.engine.kv_pool import KVLayout
        dtype = self.lm.dtype
        kv = KVLayout.from_text_config(self.lm.text_config, dtype, "cpu").bytes_per_token
        embed = self.lm.text_config.hidden_size * torch.empty((), dtype=dtype).element_size()
        n = 64 << 20
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        host = n / self._time(lambda: dst.copy_(src)) / 1e9
        links = [pf.LinkPoint("same_host", host)]
        if self.device.startswith("cuda"):
            a = torch.empty(n, dtype=torch.uint8, device=self.device)
            b = torch.empty_like(a)
            links.append(pf.LinkPoint("same_device", n / self._time(lambda: b.copy_(a)) / 1e9))
        else:
            links.append(pf.LinkPoint("same_device", host))
        return pf.Transfer(embed, kv, tuple(links))

    def measure_interference(self) -> list[pf.Interference]:
        """Encode of the reference batch while a prefill runs in another thread on the same
        device (and the reverse), over each alone: the slowdown of sharing it uncontrolled."""
        import threading
        if not self.modalities:
            return []
        ref = self.modalities[0]
        items = [self._item(ref, reference_size(self.plan, ref)) for _ in range(max(self.plan.encode_batches))]
        reqs = self._prefill_reqs(max(self.plan.prompt_lens), 1)
        enc = lambda: self.enc.encode(items)  # noqa: E731
        pre = lambda: self.lm.prefill(reqs)  # noqa: E731
        alone = {"encode": self._time(enc), "prefill": self._time(pre)}
        out = []
        for stage, fn, other in (("encode", enc, pre), ("prefill", pre, enc)):
            stop = threading.Event()

            def busy(f=other) -> None:
                while not stop.is_set():
                    f()
                    self.sync()
            t = threading.Thread(target=busy, daemon=True)
            t.start()
            try:
                shared = self._time(fn)
            finally:
                stop.set()
                t.join()
            out.append(pf.Interference(stage, "prefill" if stage == "encode" else "encode",
                                       max(1.0, shared / alone[stage])))
        self.tick("interference")
        return out


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


def parse_tiers(text: str) -> dict[str, float]:
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 3 or not all(v > 0 for v in vals) or vals != sorted(vals):
        raise ValueError(f"--tiers takes three increasing multipliers tight,moderate,loose (e.g. 2,4,8), got {text!r}")
    return dict(zip(pf.TIERS, vals))


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

        from hasctl.profile_sharing import measure_sharing
        sharing = measure_sharing(prof, torch.get_num_threads(), len(os.sched_getaffinity(0)), plan.sharing_busy,
                                  quick)
    finally:
        bar.close()
    return pf.Profile(ep.hardware(device, devices), ep.versions(), ep.model_info(model, prof.modalities), encode,
                      tuple(prefill), tuple(decode), tuple(unloaded), pf.tiers_from(unloaded, multipliers),
                      ep.utc_now(), quick, revision=pf.REVISION,
                      gateway=tuple(gateway), transfer=transfer, interference=tuple(interference),
                      sharing=tuple(sharing))


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
        from hasctl import roofline_profile
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
    return 0


def _core_text(cores: tuple[int, ...]) -> str:
    if cores == tuple(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))
