"""DecodeEngine: continuous batching over engine-owned KV memory.

A request arrives as a `KVPayload` (prompt KV + the first token prefill sampled), waits in a
bounded queue until its whole reservation (prompt_len + max_tokens) fits the pool, then
decodes one token per `step()` together with every other running request: one forward over
the batch's last tokens through the adapter's decoder, with `PoolCache` as the cache.
Requests join and leave between steps; `abort` frees KV at once.

Outputs: each request's first StepOutput (index 0) is the prefill's first token, so the
stop rules, the text and the finish reason are decided here for every token; a service that
already forwarded that token id from prefill can skip index 0's id (not its text).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from easerve.engine.attention import PoolCache, step_attention_kwargs, use_engine_attention
from easerve.engine.block_manager import BlockManager
from easerve.engine.detok import Detokenizer
from easerve.engine.kv_pool import KVLayout, KVPool
from easerve.engine.sampler import sample
from easerve.engine.scheduler import Scheduler, SchedulerOutput
from easerve.types import KVPayload, SamplingParams

FinishReason = Literal["stop", "length", "abort"]
DEFAULT_KV_TOKENS = 16384  # paged pool size when neither KV geometry is given


@dataclass(frozen=True)
class EngineConfig:
    """KV geometry: either paged (`kv_capacity_tokens` in blocks of `block_size`; suits GPUs)
    or slots (`num_slots` slots of `max_seq_len` tokens each; suits CPUs). Neither given:
    paged with DEFAULT_KV_TOKENS. In paged mode `max_seq_len`, if set, caps
    prompt_len + max_tokens of one request."""

    max_running: int = 64
    max_waiting: int = 256
    kv_capacity_tokens: int | None = None
    num_slots: int | None = None
    max_seq_len: int | None = None
    block_size: int = 16
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_capacity_tokens is not None and self.num_slots is not None:
            raise ValueError("set only one of kv_capacity_tokens (paged KV) or num_slots with max_seq_len (slots)")
        if self.num_slots is not None and (self.num_slots < 1 or not self.max_seq_len or self.max_seq_len < 2):
            raise ValueError(f"slot KV needs num_slots >= 1 and max_seq_len >= 2, got {self.num_slots}, {self.max_seq_len}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one block "
                             f"of block_size={self.block_size}")

    def geometry(self) -> tuple[int, int, int | None]:
        """(num_blocks, block_size, max tokens per request)."""
        if self.num_slots is not None:
            return self.num_slots, self.max_seq_len, self.max_seq_len
        tokens = self.kv_capacity_tokens or DEFAULT_KV_TOKENS
        return max(1, tokens // self.block_size), self.block_size, self.max_seq_len


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_id: int | None        # None only on an abort notice
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    index: int                  # position of token_id in the request's output (0 = prefill's token)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_free_tokens: int
    kv_used_tokens: int
    kv_reserved_tokens: int
    kv_capacity_tokens: int
    kv_bytes: int


@dataclass
class _Request:
    payload: KVPayload | None   # dropped once its KV is in the pool
    sampling: SamplingParams
    rope_delta: int
    stop_ids: frozenset[int]
    detok: Detokenizer | None
    tokens: list[int]


class DecodeEngine:
    def __init__(self, adapter: Any, config: EngineConfig) -> None:
        self.adapter = adapter
        self.config = config
        self.device = torch.device(config.device)
        if torch.device(adapter.device).type != self.device.type:
            raise ValueError(f"EngineConfig.device is {config.device!r} but the model is on {adapter.device}; "
                             "load the adapter on the engine's device")
        num_blocks, block_size, max_seq = config.geometry()
        self.blocks = BlockManager(num_blocks, block_size, max_seq)
        self.scheduler = Scheduler(self.blocks, config.max_running, config.max_waiting)
        layout = KVLayout.from_text_config(adapter.text_config, adapter.dtype, self.device)
        self.pool = KVPool(layout, self.blocks)
        use_engine_attention(adapter.language_model)
        self._eos = frozenset(adapter.eos_token_ids)
        self._tokenizer = adapter.tokenizer
        self._reqs: dict[str, _Request] = {}
        self._pending: list[StepOutput] = []

    # ---- intake ---------------------------------------------------------------------------
    def add(self, payload: KVPayload) -> None:
        """Queue a prefilled request. Raises ValueError on a bad payload, RequestTooLarge if
        it can never fit, Overloaded if the waiting queue is full."""
        rid, sp = payload.request_id, payload.sampling
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in the engine; ids must be unique")
        if payload.num_tokens != payload.prompt_len:
            raise ValueError(f"payload KV holds {payload.num_tokens} tokens but prompt_len is {payload.prompt_len}")
        self.pool.check_prompt_kv(payload.keys, payload.values, payload.prompt_len)
        if sp.stop and self._tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this adapter has none, use stop_token_ids")
        req = _Request(payload, sp, payload.rope_delta,
                       frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self._eos),
                       self._make_detok(payload), [])
        first = self._on_token(rid, req, payload.first_token)
        if not first.finished:
            self.scheduler.add(rid, payload.prompt_len, sp.max_tokens)
            self._reqs[rid] = req
        self._pending.append(first)

    def reserve(self, request_id: str, prompt_len: int, max_tokens: int, ttl_s: float = 60.0) -> None:
        """Hold a place before prefill runs (see Scheduler.reserve); `add` of the same id takes
        it. Raises Overloaded / RequestTooLarge exactly as `add` would, before any compute."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.scheduler.reserve(request_id, prompt_len, max_tokens, time.monotonic(), ttl_s)

    def _make_detok(self, payload: KVPayload) -> Detokenizer | None:
        if self._tokenizer is None:
            return None
        return Detokenizer(self._tokenizer, payload.prompt_ids_tail, payload.sampling.stop)

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request and free its KV now; the next step() reports
        it with finish_reason "abort". False if the engine does not hold it."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return self.scheduler.abort(request_id)  # a reservation, if any
        self.scheduler.abort(request_id)
        self._pending.append(StepOutput(request_id, None, "", True, "abort", len(req.tokens)))
        return True

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit what fits, decode one token for every running request, return the outputs
        (plus those of requests finished by add() or abort() since the last step)."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        for rid in plan.admitted:
            req = self._reqs[rid]
            self.pool.write_prompt(self.blocks.block_table(rid), req.payload.keys, req.payload.values)
            req.payload = None
        if plan.batch_size == 0:
            return outputs
        finished = []
        for rid, tok in zip(plan.request_ids, self._forward(plan)):
            out = self._on_token(rid, self._reqs[rid], tok)
            outputs.append(out)
            if out.finished:
                finished.append(rid)
                del self._reqs[rid]
        self.scheduler.update_from_output(finished)
        return outputs

    def _forward(self, plan: SchedulerOutput) -> list[int]:
        reqs = [self._reqs[rid] for rid in plan.request_ids]
        dev, bs = self.device, self.blocks.block_size
        pos = torch.tensor(plan.positions, device=dev)
        kv_len = max(plan.positions) + 1
        nb = self.blocks.blocks_needed(kv_len)
        table = torch.tensor([(t + (0,) * nb)[:nb] for t in plan.block_tables], device=dev)
        cache = PoolCache(self.pool, table.gather(1, (pos // bs)[:, None])[:, 0], pos % bs, table, kv_len)
        last = torch.tensor([[r.tokens[-1]] for r in reqs], device=dev)
        deltas = torch.tensor([r.rope_delta for r in reqs], device=dev)
        logits = self.adapter.lm_forward(
            self.adapter.embed_tokens(last), self.adapter.decode_position_ids(pos, deltas),
            cache, **step_attention_kwargs(pos + 1, kv_len))
        return sample(logits[:, -1], [r.sampling for r in reqs], [len(r.tokens) for r in reqs])

    def _on_token(self, rid: str, req: _Request, token: int) -> StepOutput:
        """Record a sampled token and apply the stop rules (stop ids / eos, stop strings,
        max_tokens, in that order)."""
        req.tokens.append(token)
        detok, reason = req.detok, None
        if token in req.stop_ids:
            reason, delta = "stop", detok.finish() if detok else ""
        else:
            delta = detok.push(token) if detok else ""
            if detok and detok.stop_hit is not None:
                reason = "stop"
            elif len(req.tokens) >= req.sampling.max_tokens:
                reason, delta = "length", delta + (detok.finish() if detok else "")
        return StepOutput(rid, token, delta, reason is not None, reason, len(req.tokens) - 1)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, b.free_tokens,
                           b.used_tokens, b.reserved_tokens, b.capacity_tokens, self.pool.nbytes)
