"""The whole E -> P -> D path in one process: the reference the services are
checked against, the `hasctl demo` job, and the in-process side of benchmarks.

It uses the very same pieces the services use (adapters by role, the sampler,
the decode engine); only the transports between them are missing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from easerve.engine.detok import prompt_tail
from easerve.engine.config import DEFAULT_KV_TOKENS, EngineConfig
from easerve.engine.engine import DecodeEngine
from easerve.engine.logit_transforms import TokenHistory, penalty_prompt_ids
from easerve.engine.sampler import sample
from easerve.models.loader import load_adapter
from easerve.types import KVPayload, PrefillRequest, ProcessedPrompt, SamplingParams, items_meta


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class InProcessPipeline:
    """Encode, prefill and a continuous-batching decode engine over one checkpoint."""

    def __init__(self, model: str, device: str = "cpu", engine: EngineConfig | None = None):
        self.encoder = load_adapter(model, role="encode", device=device)
        self.lm = load_adapter(model, role="decode", device=device)
        self.engine = DecodeEngine(self.lm, engine or EngineConfig(kv_capacity_tokens=DEFAULT_KV_TOKENS))
        self._ids = itertools.count()

    def prepare(self, messages: list[dict]) -> ProcessedPrompt:
        return self.encoder.preprocess(messages)

    def start(self, prompt: ProcessedPrompt, sampling: SamplingParams) -> tuple[str, int]:
        """Encode + prefill one request and hand it to the engine; returns (id, first token)."""
        rid = f"req-{next(self._ids)}"
        embeds = self.encoder.encode(prompt.items) if prompt.items else []
        req = PrefillRequest(rid, prompt.input_ids, embeds,
                             items_meta(prompt.items), sampling)
        res = self.lm.prefill([req])[0]
        history = TokenHistory.start(sampling, prompt.input_ids, self.lm.eos_token_ids, self.lm)
        first = sample(res.last_logits[None], [sampling], [0], [history])[0]
        self.engine.add(KVPayload(rid, res.keys, res.values, res.prompt_len, res.rope_delta,
                                  first, sampling, prompt_ids_tail=prompt_tail(prompt.input_ids),
                                  penalty_ids=penalty_prompt_ids(sampling, prompt.input_ids)))
        return rid, first

    def run(self, requests: list[tuple[list[dict], SamplingParams]]) -> list[Completion]:
        """Run a batch of chat requests to completion; outputs in request order."""
        outs: dict[str, Completion] = {}
        order = []
        for messages, sampling in requests:
            rid, _ = self.start(self.prepare(messages), sampling)
            outs[rid] = Completion(rid)
            order.append(rid)
        while self.engine.has_work:
            for o in self.engine.step():
                c = outs[o.request_id]
                if o.token_id is not None:
                    c.token_ids.append(o.token_id)
                c.text += o.text_delta or ""
                if o.finished:
                    c.finish_reason = o.finish_reason
        return [outs[r] for r in order]
