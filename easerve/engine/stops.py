"""The stop rules of one request, in one place: stop token ids / EOS, stop strings and
max_tokens, applied token by token together with the incremental detokenizer.

Prefill applies them to the first token (it samples it) and the decode engine to every
token after, replaying the first so both sides hold the same state; nothing else decides
when a request ends or what text it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from easerve.engine.detok import Detokenizer
from easerve.types import SamplingParams

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenVerdict:
    text: str                       # text that became final with this token
    finish_reason: StopReason | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopRules:
    """Order of the rules: a stop id (or EOS, unless ignore_eos) ends the request without
    its text; then a stop string (text cut right before it); then max_tokens. `prompt_tail`
    ends before a resumed request's `sampling.resumed`, which the rules replay first."""

    def __init__(self, sampling: SamplingParams, eos_ids, tokenizer: Any = None,
                 prompt_tail: list[int] | tuple[int, ...] = ()) -> None:
        if sampling.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this adapter has none, use stop_token_ids")
        self.sampling = sampling
        self.stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos
                                                              else frozenset(eos_ids))
        self.detok = Detokenizer(tokenizer, prompt_tail, sampling.stop) if tokenizer is not None else None
        self.count = 0
        for token in sampling.resumed:  # a migrated request's earlier tokens: their text went out before
            self.push(token)

    def push(self, token: int) -> TokenVerdict:
        self.count += 1
        detok = self.detok
        if detok is not None:  # as vLLM: stop strings only count from the min_tokens-th token on
            detok.find_stops = self.count >= self.sampling.min_tokens
        if token in self.stop_ids:
            return TokenVerdict(detok.finish() if detok else "", "stop")
        delta = detok.push(token) if detok else ""
        if detok is not None and detok.stop_hit is not None:
            return TokenVerdict(delta, "stop")
        if self.count >= self.sampling.max_tokens:
            return TokenVerdict(delta + (detok.finish() if detok else ""), "length")
        return TokenVerdict(delta, None)
