"""`hasctl profile`'s measurements in this process: `Profiler` holds the model's adapters on one
device and a timer, and each `measure_*` returns the profile_format points of one section (see
hasctl.profile for what is measured and how)."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from easerve import profile_format as pf
from easerve.engine.detok import prompt_tail
from easerve.partition.backends import select_backend
from easerve.stages.encode import profiler as ep
from hasctl.profile_plan import Plan, reference_size, sizes_of


class Profiler:
    """Holds the adapters and a timer; each `measure_*` returns profile_format points."""

    def __init__(self, model: str, device: str, plan: Plan, tick: Callable[[str], None] = lambda _s: None):
        from easerve.models.loader import load_adapter
        self.model, self.device, self.plan, self.tick = model, device, plan, tick
        self.enc = load_adapter(model, role="encode", device=device)
        self.lm = load_adapter(model, role="decode", device=device)
        self.modalities = tuple(self.enc.modalities)
        self.sync = ep.device_sync(device)

    def timed(self, fn: Callable[[], object]) -> float:
        """The median of the plan's repeats of `fn` after one warm-up call (device synchronized)."""
        return ep.time_call(fn, self.plan.repeats, sync=self.sync)

    def media_item(self, modality: str, size):
        return ep.synthetic_item(self.enc, modality, size)

    # ---- encode -------------------------------------------------------------------------------
    def measure_encode(self) -> pf.EncodeProfile:
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
        item = self.media_item(modality, size)
        lat = self.timed(lambda: self.enc.encode([item] * batch))
        self.tick(f"encode {modality} {ep.media_label(modality, size)} b={batch}")
        return pf.EncodeSizePoint(modality, ep.media_label(modality, size), int(item.num_tokens), batch, lat)

    # ---- prefill / decode ------------------------------------------------------------------------
    def _prompt(self, n: int, seed: int) -> list[int]:
        import numpy as np
        avoid = set(getattr(self.lm, "placeholder_ids", {}).values()) | set(self.lm.eos_token_ids)
        rng = np.random.default_rng(seed)
        ids = [int(t) for t in rng.integers(10, self.lm.text_config.vocab_size, 2 * n + 16) if int(t) not in avoid]
        return ids[:n]

    def prefill_reqs(self, n: int, batch: int, max_tokens: int = 16):
        from easerve.types import PrefillRequest, SamplingParams
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return [PrefillRequest(f"p{i}", self._prompt(n, i), [], [], sp) for i in range(batch)]

    def measure_prefill(self) -> list[pf.PrefillPoint]:
        out = []
        limit = int(getattr(self.lm.text_config, "max_position_embeddings", 1 << 20)) - 64
        for n in (min(n, limit) for n in self.plan.prompt_lens):
            for b in self.plan.prefill_batches:
                reqs = self.prefill_reqs(n, b)
                out.append(pf.PrefillPoint(n, b, self.timed(lambda: self.lm.prefill(reqs))))
                self.tick(f"prefill len={n} b={b}")
        return out

    def decode_engine(self, batch: int, tokens_per_req: int):
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
        [req] = self.prefill_reqs(ctx, 1, max_tokens=8 + plan.decode_steps * (plan.repeats + 1))
        res = self.lm.prefill([req])[0]
        engine = self.decode_engine(batch, ctx + req.sampling.max_tokens)
        for i in range(batch):
            engine.add(KVPayload(f"d{i}", res.keys, res.values, res.prompt_len, res.rope_delta, 11,
                                 req.sampling, prompt_tail(req.input_ids)))
        engine.step()
        running = engine.stats().running
        if running != batch:
            raise RuntimeError(f"decode batch {batch}: only {running} requests admitted; the KV sizing is off")
        step = self.timed(lambda: [engine.step() for _ in range(plan.decode_steps)]) / plan.decode_steps
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
        engine = self.decode_engine(1, 16384)
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
        """What the gateway spends preprocessing one request (hasctl/profile_gateway.py)."""
        from hasctl.profile_gateway import measure_gateway
        return measure_gateway(self.model, self.modalities, self.plan)

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
        host = n / self.timed(lambda: dst.copy_(src)) / 1e9
        links = [pf.LinkPoint("same_host", host)]
        if self.device.startswith("cuda"):
            a = torch.empty(n, dtype=torch.uint8, device=self.device)
            b = torch.empty_like(a)
            links.append(pf.LinkPoint("same_device", n / self.timed(lambda: b.copy_(a)) / 1e9))
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
        items = [self.media_item(ref, reference_size(self.plan, ref)) for _ in range(max(self.plan.encode_batches))]
        reqs = self.prefill_reqs(max(self.plan.prompt_lens), 1)
        enc = lambda: self.enc.encode(items)  # noqa: E731
        pre = lambda: self.lm.prefill(reqs)  # noqa: E731
        alone = {"encode": self.timed(enc), "prefill": self.timed(pre)}
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
                shared = self.timed(fn)
            finally:
                stop.set()
                t.join()
            out.append(pf.Interference(stage, "prefill" if stage == "encode" else "encode",
                                       max(1.0, shared / alone[stage])))
        self.tick("interference")
        return out
