"""DecodeEngine: continuous batching over engine-owned KV memory.

A request arrives as a `KVPayload` (prompt KV + the first token prefill sampled), waits in a
bounded queue until its whole reservation (prompt_len + max_tokens) fits the pool, then
decodes one token per `step()` together with every other running request: one forward over
the batch's last tokens through the adapter's decoder, with a step cache of the attention
backend (`attention.select_attention`) as the cache. Requests join and leave between steps;
`abort` frees KV at once. The KV pool is sized by `EngineConfig` (tokens, slots or memory).

Outputs: each request's first StepOutput (index 0) is the prefill's first token, so the
stop rules, the text and the finish reason are decided here for every token; a service that
already forwarded that token id from prefill can skip index 0's id (not its text).

n > 1 (`SamplingParams.n`): the payload carries every choice's first token; `add` forks the
request into n sequences (ids `request_id#i`; the request id itself when n = 1), each with
its own sampling (`SamplingParams.choice(i)`: seed + i), stop rules and grammar state, that
share the prompt's full KV blocks (`BlockManager.allocate_group`); a choice whose first token
ends it never becomes a sequence. Outputs name the request and their `choice`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch

from easerve.engine import attention as att
from easerve.engine import cpu_gemv
from easerve.engine.block_manager import BlockManager
from easerve.engine.config import EngineConfig, default_max_len, gpu_kv_budget
from easerve.engine.logprobs import TokenLogprobs, token_logprobs
from easerve.engine.stops import StopRules
from easerve.engine.kv_pool import KVLayout, PagedKVPool, SlotKVPool
from easerve.engine.logit_transforms import TokenHistory
from easerve.engine.sampler import sample
from easerve.engine.scheduler import Scheduler, SchedulerOutput
from easerve.errors import InvalidRequest
from easerve.models.base import ModelAdapter
from easerve.types import KVPayload, SamplingParams

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]
FLASHINFER_WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_id: int | None        # None only on an abort notice
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    index: int                  # position of token_id in the request's output (0 = prefill's token)
    logprobs: TokenLogprobs | None = None  # when the request asked for them (not for index 0)
    choice: int = 0             # which of the request's n choices (0 when n = 1)


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
class _StepInputs:
    request_ids: tuple[str, ...]
    pos: torch.Tensor           # [B] the position each row writes
    tokens: torch.Tensor        # [B] each row's last token (after the step: the sampled ones)
    deltas: torch.Tensor        # [B] rope deltas
    slot_index: torch.Tensor | None  # slot layout: where the step writes (SlotKVPool.step_index)
    greedy: bool


@dataclass
class _Request:
    payload: KVPayload | None   # dropped once its KV is in the pool
    sampling: SamplingParams
    rope_delta: int
    rules: StopRules
    tokens: list[int]
    history: TokenHistory | None = None  # for penalties / logit_bias / min_tokens / grammar
    request_id: str = ""        # the request this sequence is a choice of
    choice: int = 0


class DecodeEngine:
    def __init__(self, adapter: ModelAdapter, config: EngineConfig) -> None:
        self.adapter = adapter
        self.config = config
        self.device = torch.device(config.torch_device)
        if torch.device(adapter.device).type != self.device.type:
            raise ValueError(f"EngineConfig.device is {config.device!r} but the model is on {adapter.device}; "
                             "load the adapter on the engine's device")
        layout = KVLayout.from_text_config(adapter.text_config, adapter.dtype, self.device)
        flashinfer = att.import_flashinfer() if self.device.type == "cuda" else None
        paged_kernel = att.paged_kernel_available(self.device.type, layout.dtype, flashinfer is not None,
                                                  layout.head_dim)
        self.geometry = config.kv_geometry(layout.bytes_per_token, self._gpu_budget(), paged_kernel,
                                           model_len=default_max_len(adapter.text_config))
        self.backend = att.select_attention(self.geometry.layout, paged_kernel)
        g = self.geometry
        self.blocks = BlockManager(g.num_blocks, g.block_size, g.max_seq_tokens)
        slots = g.layout == "slots"
        self.scheduler = Scheduler(self.blocks, config.max_running, config.max_waiting, compact=slots)
        self.pool = (SlotKVPool if slots else PagedKVPool)(layout, self.blocks)
        self._wrapper = None
        if self.backend == "flashinfer":
            self._wrapper = att.flashinfer_decode_wrapper(
                flashinfer, adapter.text_config.num_attention_heads, layout.kv_heads, self.device,
                FLASHINFER_WORKSPACE_BYTES)
        att.use_engine_attention(adapter.language_model)
        self.linear_layouts = self._choose_linear_layouts(adapter)
        self._eos = frozenset(adapter.eos_token_ids)
        self._tokenizer = adapter.tokenizer
        self._reqs: dict[str, _Request] = {}   # by sequence id
        self._groups: dict[str, list[str]] = {}  # request id -> its unfinished sequences
        self._unwritten: set[str] = set()  # running requests whose prompt KV is not in the pool yet
        self._pending: list[StepOutput] = []
        self._last: _StepInputs | None = None  # the last step's inputs, if every row was greedy
        self.last_step: tuple[int, int] = (0, 0)  # the last step's batch size and mean context

    def _choose_linear_layouts(self, adapter: ModelAdapter) -> dict:
        """CPU: store the LM's linear weights in whichever layout decodes faster (cpu_gemv)."""
        if self.device.type != "cpu" or self.config.linear_layout != "auto":
            return {}
        slot = adapter.lm_head_slot()
        decision = cpu_gemv.apply(adapter.language_model, adapter.dtype, extra=[slot] if slot else [])
        log.info("linear layouts: %d of %d shapes stored transposed (%s)", sum(decision.values()), len(decision),
                 ", ".join(f"{o}x{i}" for (o, i, _), t in decision.items() if t) or "none")
        return decision

    def _gpu_budget(self) -> int | None:
        if self.config.sizing != "gpu_memory_utilization":
            return None
        util = self.config.gpu_memory_utilization
        free, total = torch.cuda.mem_get_info(self.device)
        return gpu_kv_budget(total, free, torch.cuda.memory_allocated(self.device), util)

    # ---- intake ---------------------------------------------------------------------------
    def add(self, payload: KVPayload) -> None:
        """Queue a prefilled request (its n choices). Raises ValueError on a bad payload,
        RequestTooLarge if it can never fit, Overloaded if the waiting queue is full. A request
        whose first tokens already finish every choice never enters the queue and gives back
        its reservation."""
        rid, sp, firsts = payload.request_id, payload.sampling, payload.choice_tokens
        if rid in self._groups or rid in self._reqs:
            raise InvalidRequest(f"request id {rid!r} is already in the engine; ids must be unique")
        if payload.num_tokens != payload.prompt_len:
            raise InvalidRequest(f"payload KV holds {payload.num_tokens} tokens but prompt_len is {payload.prompt_len}")
        if len(firsts) != sp.n:
            raise InvalidRequest(f"payload carries {len(firsts)} first tokens for n = {sp.n}; one per choice")
        self.pool.check_prompt_kv(payload.keys, payload.values, payload.prompt_len)
        live, outs = {}, []
        for i, tok in enumerate(firsts):
            ci = sp.choice(i)
            req = _Request(payload, ci, payload.rope_delta,
                           StopRules(ci, self._eos, self._tokenizer, payload.prompt_ids_tail), [],
                           TokenHistory.start(ci, payload.penalty_ids, self._eos, self.adapter), rid, i)
            outs.append(self._on_token(req, tok))
            if not outs[-1].finished:
                live[rid if sp.n == 1 else f"{rid}#{i}"] = req
        if not live:
            self.scheduler.release_reservation(rid)
        else:
            self.scheduler.add(rid, payload.prompt_len, sp.tokens_left, tuple(live))
            self._reqs.update(live)
            self._groups[rid] = list(live)
        self._pending.extend(outs)

    def reserve(self, request_id: str, prompt_len: int, max_tokens: int, ttl_s: float = 60.0, n: int = 1) -> None:
        """Hold a place (for n choices) before prefill runs (see Scheduler.reserve); `add` of the
        same id takes it. Raises Overloaded / RequestTooLarge exactly as `add` would, before any compute."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.scheduler.reserve(request_id, prompt_len, max_tokens, time.monotonic(), ttl_s, n)

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request (every unfinished choice) and free its KV now;
        the next step() reports each such choice with finish_reason "abort". False if the
        engine does not hold it."""
        seqs = self._groups.pop(request_id, None)
        if seqs is None:
            return self.scheduler.abort(request_id)  # a reservation, if any
        self.scheduler.abort(request_id)  # still waiting as one entry
        for sid in seqs:
            req = self._reqs.pop(sid)
            self.scheduler.abort(sid)
            self._unwritten.discard(sid)
            self._pending.append(StepOutput(request_id, None, "", True, "abort", len(req.tokens), choice=req.choice))
        self._last = None
        return True

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit what fits, decode one token for every running request, return the outputs
        (plus those of requests finished by add() or abort() since the last step).
        If the forward (or anything before the tokens) raises, the exception propagates
        and the step is undone: positions go back, admitted requests stay running with
        their prompt still to write, pending outputs are kept for the next step."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        n = plan.batch_size  # (rows, mean tokens each attends to) of this step: the decode call spans
        self.last_step = (n, (sum(plan.positions) + n) // n if n else 0)
        self._unwritten.update(plan.admitted)
        if plan.batch_size == 0:
            return outputs
        try:
            self._move_and_write(plan)
            tokens, logprobs = self._forward(plan)
        except BaseException:
            self._last = None
            self.scheduler.retract(plan)
            self._pending = outputs + self._pending
            raise
        finished = []
        for sid, tok, lp in zip(plan.request_ids, tokens, logprobs):
            out = self._on_token(self._reqs[sid], tok, lp)
            outputs.append(out)
            if out.finished:
                finished.append(sid)
                self._finish(sid)
        self.scheduler.update_from_output(finished)
        return outputs

    def _finish(self, seq_id: str) -> None:
        rid = self._reqs.pop(seq_id).request_id
        group = self._groups[rid]
        group.remove(seq_id)
        if not group:
            del self._groups[rid]

    def _move_and_write(self, plan: SchedulerOutput) -> None:
        """Copy the KV of requests the plan moved (slot layout), then write new prompts."""
        if plan.moves:
            pos = dict(zip(plan.request_ids, plan.positions))
            for rid, src, dst in plan.moves:
                if rid not in self._unwritten:
                    self.pool.move(src, dst, pos[rid])  # positions 0..pos-1 hold KV
        if self._unwritten:
            tables = dict(zip(plan.request_ids, plan.block_tables))
            for sid in list(self._unwritten):  # a choice skips the full blocks it shares
                req = self._reqs[sid]
                if isinstance(self.pool, SlotKVPool):
                    self.pool.write_prompt(tables[sid][0], req.payload.keys, req.payload.values)
                else:
                    self.pool.write_prompt(tables[sid], req.payload.keys, req.payload.values,
                                           start=self.blocks.borrowed_tokens(sid))
                req.payload = None
                self._unwritten.discard(sid)

    def _forward(self, plan: SchedulerOutput) -> tuple[list[int], list[TokenLogprobs | None]]:
        inputs = self._inputs(plan)
        cache = self._step_cache(plan, inputs)
        logits = self.adapter.lm_forward(self.adapter.embed_tokens(inputs.tokens[:, None]),
                                         self.adapter.decode_position_ids(inputs.pos, inputs.deltas),
                                         cache, **cache.forward_kwargs())[:, -1]
        reqs = [self._reqs[rid] for rid in plan.request_ids]
        if inputs.greedy:  # keep the token tensor: the next step of the same batch feeds it back
            inputs.tokens = logits.argmax(dim=-1)
            self._last = inputs
            tokens = inputs.tokens.tolist()
        else:
            tokens = sample(logits, [r.sampling for r in reqs], [len(r.sampling.resumed) + len(r.tokens) for r in reqs],
                            [r.history for r in reqs])
        return tokens, token_logprobs(logits, tokens, [r.sampling.logprobs for r in reqs])

    def _inputs(self, plan: SchedulerOutput) -> "_StepInputs":
        """The step's device tensors. The same batch as the last (greedy) step, unchanged since:
        positions + 1 and the tokens it sampled, with no host->device copy."""
        last, self._last = self._last, None
        if last is not None and last.request_ids == plan.request_ids and not plan.admitted and not plan.moves:
            last.pos = last.pos + 1
            last.slot_index = None if last.slot_index is None else last.slot_index + 1
            return last
        reqs = [self._reqs[rid] for rid in plan.request_ids]
        host = torch.tensor([*plan.positions, *(r.tokens[-1] for r in reqs), *(r.rope_delta for r in reqs)])
        pos, tokens, deltas = host.to(self.device).split(len(reqs))  # one host->device copy
        index = self.pool.step_index(len(reqs), pos) if self.backend == "slots" else None
        greedy = all(r.sampling.greedy and not r.sampling.transforms_logits for r in reqs)
        return _StepInputs(plan.request_ids, pos, tokens, deltas, index, greedy)

    def _step_cache(self, plan: SchedulerOutput, inputs: "_StepInputs"):
        positions, pos = plan.positions, inputs.pos
        kv_len = max(positions) + 1
        if self.backend == "slots":  # rows are slots 0..B-1 (the scheduler compacts)
            return att.SlotStepCache(self.pool, inputs.slot_index, kv_len, att.length_mask(positions, pos, kv_len))
        bs, dev = self.blocks.block_size, self.device
        blk = torch.tensor([t[p // bs] for t, p in zip(plan.block_tables, positions)], device=dev)
        off = pos % bs
        if self.backend == "flashinfer":
            return att.FlashInferStepCache(self.pool, self._wrapper, blk, off, plan.block_tables, positions)
        nb = self.blocks.blocks_needed(kv_len)
        table = torch.tensor([(t + (0,) * nb)[:nb] for t in plan.block_tables], device=dev)
        return att.PagedStepCache(self.pool, blk, off, table, kv_len, att.length_mask(positions, pos, kv_len))

    def _on_token(self, req: _Request, token: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """Record a sampled token and apply the choice's stop rules (easerve.engine.stops)."""
        req.tokens.append(token)
        if req.history is not None:
            req.history.push(token)
        v = req.rules.push(token)
        return StepOutput(req.request_id, token, v.text, v.finished, v.finish_reason, len(req.tokens) - 1, logprobs,
                          req.choice)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, b.free_tokens,
                           b.used_tokens, b.reserved_tokens, b.capacity_tokens, self.pool.nbytes)
