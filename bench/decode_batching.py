"""Decode throughput of DecodeEngine at batch 1, 4, 16, 64, measured in one run.

Each batch size gets a fresh engine filled with prefilled random prompts (~64 tokens); after
a few warm-up steps every request is running and `steps` timed engine steps follow (the
whole step: scheduling, forward, sampling, detokenization). The engine is configured as the
decode service configures it on that device: KV sized from memory, layout "auto" (on CPU the
slot layout read in place; on CPU each linear shape in the weight layout that measured
faster, easerve/engine/cpu_gemv.py). Baselines of the same run: batch 1 of the engine, and
HF's own greedy decode on a second copy of the model no engine touched, its forward over a
DynamicCache at each batch size (one prompt repeated, so no padding mask, no engine). HF and
engine steps alternate, and each rate comes from the median step time, so load from other
processes hits both alike.
Last stdout line: one JSON object, ratios first: "engine_over_hf_b1" and "engine_over_hf_b16"
(engine tok/s over HF's at batch 1 / 16, targets >= 1.0), "b16_over_b1" (target >= 8), then
tok/s per batch.

  python bench/decode_batching.py --text-lm            # tests/models/text_lm.py at ~57 M params
  python bench/decode_batching.py --model DIR          # any checkpoint easerve can load
  python bench/decode_batching.py                      # easerve.models.tiny bench-scale llava-next
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder (loaded with role='decode')")
    src.add_argument("--text-lm", action="store_true", help="use the tests' text LM at bench size")
    src.add_argument("--text-lm-spec", default=None,
                     help='the tests\' text LM with these TextLMSpec fields, JSON (e.g. a 4-layer 7B shape: '
                          '{"family": "qwen2", "hidden": 3584, "layers": 4, "heads": 28, "kv_heads": 4, '
                          '"intermediate": 18944})')
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-llava-next-bench"),
                    help="where the default bench checkpoint is built once")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64, help="timed steps per batch size (engine and HF each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layout", choices=("auto", "paged", "slots"), default="auto", help="the engine's KV layout")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="engine KV memory (default: what the run needs; on cuda --gpu-memory-utilization 0.9)")
    ap.add_argument("--no-hf-baseline", action="store_true", help="skip the plain DynamicCache decode baseline")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch CPU threads (default: every core this process may use, as a deployment would)")
    ap.add_argument("--seed", type=int, default=0)
    add_save_flag(ap)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.steps < 1 or args.prompt_len < 2:
        ap.error("--batches must be >= 1, --steps >= 1, --prompt-len >= 2")
    return args


def load(args):
    if args.text_lm or args.text_lm_spec:
        from tests.models.text_lm import TextLMSpec, build_text_lm
        spec = TextLMSpec(**json.loads(args.text_lm_spec)) if args.text_lm_spec else TextLMSpec.bench()
        return build_text_lm(spec, device=args.device, with_tokenizer=False)
    from easerve.models.loader import load_adapter
    return load_adapter(Path(checkpoint(args.model, args.cache_dir, "llava-next")), role="decode", device=args.device)


def plain_token_ids(adapter) -> list[int]:
    """Token ids a random text prompt may use: no special or added (placeholder) tokens."""
    vocab = adapter.text_config.vocab_size
    tok = adapter.tokenizer
    if tok is None:
        return list(range(vocab))
    banned = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return [i for i in range(min(vocab, len(tok))) if i not in banned]


def prefill_payloads(adapter, args, count: int, max_tokens: int):
    from easerve.engine.detok import prompt_tail
    from easerve.types import KVPayload, PrefillRequest, SamplingParams
    rng = random.Random(args.seed)
    ids_pool = plain_token_ids(adapter)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = []
    for i in range(count):
        ids = [rng.choice(ids_pool) for _ in range(args.prompt_len + rng.randint(-8, 8))]
        res = adapter.prefill([PrefillRequest(f"p{i}", ids, [], [], sp)])[0]
        first = int(res.last_logits.argmax())
        out.append(KVPayload(f"p{i}", res.keys, res.values, res.prompt_len, res.rope_delta, first, sp, prompt_tail(ids)))
    return out


def engine_stepper(adapter, payloads, batch: int, args, total_steps: int):
    """A fresh engine holding `batch` running requests -> (one timed step, its backend)."""
    from dataclasses import replace
    from easerve.engine.engine import DecodeEngine
    per_req = max(p.prompt_len for p in payloads) + total_steps + 8
    engine = DecodeEngine(adapter, engine_config(adapter, args, batch, per_req))
    for i in range(batch):
        engine.add(replace(payloads[i % len(payloads)], request_id=f"b{batch}-{i}"))
    engine.step()  # admits all: from here on every step decodes the whole batch

    def step() -> None:
        if len(engine.step()) != batch:
            raise RuntimeError("a request finished while timed; raise max_tokens")
    return step, engine.backend


def engine_config(adapter, args, batch: int, per_req: int):
    """The decode service's way: KV sized from memory, layout chosen by the engine."""
    from easerve.engine.config import GIB
    from easerve.engine.config import EngineConfig
    from easerve.engine.kv_pool import KVLayout
    common = dict(max_running=batch, max_waiting=batch, max_seq_len=per_req, block_size=16,
                  device=args.device, kv_layout=args.layout)
    if args.kv_cache_memory_gb is None and args.device.startswith("cuda"):
        return EngineConfig(gpu_memory_utilization=0.9, **common)
    if args.kv_cache_memory_gb is not None:
        return EngineConfig(kv_cache_memory_gb=args.kv_cache_memory_gb, **common)
    per_token = KVLayout.from_text_config(adapter.text_config, adapter.dtype, args.device).bytes_per_token
    return EngineConfig(kv_cache_memory_gb=batch * (per_req + 16) * per_token / GIB, **common)


def hf_stepper(adapter, payload, batch: int, args):
    """HF's own batched greedy decode, one step per call: one prompt repeated `batch` times in
    a DynamicCache, the adapter's decode hooks, no engine. `adapter` is a second copy of the
    model that no engine touched (its attention and linear layers as transformers builds them)."""
    from transformers import DynamicCache
    dev = torch.device(args.device)
    kv = [(k[None].expand(batch, -1, -1, -1).to(dev).contiguous(), v[None].expand(batch, -1, -1, -1).to(dev).contiguous())
          for k, v in zip(payload.keys, payload.values)]
    cache = DynamicCache(ddp_cache_data=kv, config=adapter.text_config)
    state = {"tok": torch.full((batch, 1), payload.first_token, device=dev), "pos": payload.prompt_len}
    delta = torch.full((batch,), payload.rope_delta, device=dev)

    @torch.inference_mode()
    def step() -> None:
        pos = torch.full((batch,), state["pos"], device=dev)
        logits = adapter.lm_forward(adapter.embed_tokens(state["tok"]), adapter.decode_position_ids(pos, delta), cache)
        state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
        state["tok"].tolist()  # the engine also hands tokens to the host every step
        state["pos"] += 1
    return step


def measure(adapter, hf_adapter, payloads, batch: int, args) -> tuple[float, float | None, str]:
    """(engine tok/s, HF tok/s or None, the engine's attention backend) at one batch size:
    engine and HF steps alternate (order flipped every step), each rate from the median step
    time, so load from other processes hits both alike."""
    total = args.warmup + args.steps
    eng, backend = engine_stepper(adapter, payloads, batch, args, total)
    steppers = {"engine": eng}
    if not args.no_hf_baseline:
        steppers["hf"] = hf_stepper(hf_adapter, payloads[0], batch, args)
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for i in range(total):
        for name in (list(steppers) if i % 2 else list(steppers)[::-1]):
            t0 = time.perf_counter()
            steppers[name]()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    rate = {k: batch / statistics.median(v) for k, v in times.items()}
    return rate["engine"], rate.get("hf"), backend


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    adapter = load(args)
    hf_adapter = None if args.no_hf_baseline else load(args)  # the baseline's own, untouched copy
    params = sum(p.numel() for p in adapter.parameters())
    print(f"model: {type(adapter).__name__} {params / 1e6:.1f} M params on {args.device}", flush=True)
    payloads = prefill_payloads(adapter, args, min(16, max(args.batches)),
                                max_tokens=args.warmup + args.steps + 4)
    hf, tok_s = {}, {}
    for b in args.batches:
        tok_s[b], hf_rate, backend = measure(adapter, hf_adapter, payloads, b, args)
        if hf_rate is not None:
            hf[b] = hf_rate
        print(f"batch {b:3d}: engine {tok_s[b]:9.1f} tok/s" + (f", hf {hf[b]:9.1f} tok/s" if hf else ""), flush=True)
    result = {f"engine_over_hf_b{b}": round(tok_s[b] / hf[b], 2) for b in (1, 16, 64, 4) if b in hf}
    result.update(ratios(tok_s, ""))
    result.update({f"b{b}_tok_s": round(v, 1) for b, v in tok_s.items()})
    result.update(ratios(hf, "hf_"))
    result.update({f"hf_b{b}_tok_s": round(v, 1) for b, v in hf.items()})
    result.update({"params_m": round(params / 1e6, 1), "device": args.device, "steps": args.steps,
                   "prompt_len": args.prompt_len, "threads": args.threads, "backend": backend})
    finish("decode_batching", args, result, argv)
    return result


def ratios(tok_s: dict[int, float], prefix: str) -> dict[str, float]:
    if 1 not in tok_s:
        return {}
    return {f"{prefix}b{b}_over_b1": round(tok_s[b] / tok_s[1], 2) for b in (16, 64, 4) if b in tok_s}


if __name__ == "__main__":
    main()
