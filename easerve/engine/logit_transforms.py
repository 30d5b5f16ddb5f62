"""Logit transforms that depend on a request's tokens, in vLLM's order: logit_bias, min_tokens,
then the penalties (repetition, frequency, presence), and last the grammar mask of a structured
output (`easerve.engine.grammar`). One batched pass over the rows that ask
for them; prefill's first token and every decode step go through `apply` (via the sampler).

Each request's token bookkeeping is a `TokenHistory` of plain ints (no tensors): the prompt's
distinct ids (repetition_penalty only), how often each token was generated, and the ids
min_tokens masks, and the request's place in its grammar. Penalties follow vLLM / OpenAI: repetition over prompt + generated tokens
(as transformers' RepetitionPenaltyLogitsProcessor over its input_ids), presence and
frequency over generated tokens only.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from easerve.types import SamplingParams


@dataclass
class TokenHistory:
    """One request's tokens as the transforms read them."""

    prompt_ids: frozenset[int] = frozenset()   # distinct prompt ids (kept only for repetition_penalty)
    stop_ids: frozenset[int] = frozenset()     # masked while fewer than min_tokens were generated
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> how many times
    grammar: Any = None  # a structured output's `grammar.GrammarState`

    @classmethod
    def start(cls, sp: SamplingParams, prompt_ids: Iterable[int], eos_ids: Iterable[int],
              adapter: Any = None) -> "TokenHistory | None":
        """The history of a request about to sample its first token; None when it needs none.
        A structured output needs the model `adapter` (its tokenizer compiles the grammar;
        InvalidRequest if it does not compile)."""
        if not sp.transforms_logits:
            return None
        grammar = None
        if sp.structured is not None:
            if adapter is None:
                raise ValueError("a structured output needs the model adapter")
            from easerve.engine.grammar import Grammars  # xgrammar loads only once a structured output comes
            grammar = Grammars.of(adapter).start(sp.structured)
        stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(eos_ids))
        history = cls(frozenset(prompt_ids) if sp.repetition_penalty != 1.0 else frozenset(),
                      stops if sp.min_tokens else frozenset(),
                      grammar=grammar)
        for token in sp.resumed:  # a migrated request's earlier tokens (`prompt_ids` ends before them)
            history.push(token)
        return history

    def push(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.grammar is not None:
            self.grammar.accept(token)


def penalty_prompt_ids(sp: SamplingParams, input_ids: Sequence[int]) -> list[int]:
    """The prompt ids decode needs to go on penalising (sorted, distinct; empty unless repetition_penalty)."""
    return sorted(set(input_ids)) if sp.repetition_penalty != 1.0 else []


def _index(rows: list[int], cols: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, device=device, dtype=torch.long), torch.tensor(cols, device=device, dtype=torch.long)


def apply(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
          histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """[N, V] logits -> float32 logits with each row's transforms applied (a new tensor when
    any row has some; `logits` itself otherwise). steps[i]: tokens row i generated so far."""
    if not any(p.transforms_logits for p in params):
        return logits
    if len(histories) != len(params):
        raise ValueError(f"{len(params)} params but {len(histories)} histories")
    out = logits.float().clone()
    vocab, dev = out.shape[-1], out.device
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias:
            if tok >= vocab:  # the gateway refuses these; a bias on no token changes nothing
                continue
            rows.append(i), cols.append(tok), vals.append(bias)
    if rows:
        r, c = _index(rows, cols, dev)
        out.index_put_((r, c), torch.tensor(vals, device=dev), accumulate=True)
    rows, cols = [], []
    for i, (p, h, n) in enumerate(zip(params, histories, steps)):
        if p.min_tokens and n < p.min_tokens and h is not None:
            ids = sorted(t for t in h.stop_ids if t < vocab)
            rows += [i] * len(ids)
            cols += ids
    if rows:
        out[_index(rows, cols, dev)] = float("-inf")
    _repetition(out, params, histories)
    _frequency_presence(out, params, histories)
    if any(h is not None and h.grammar is not None for h in histories):
        from easerve.engine import grammar  # xgrammar loads only once a structured output comes
        grammar.mask(out, [None if h is None else h.grammar for h in histories])
    return out


def _repetition(out: torch.Tensor, params, histories) -> None:
    rows, cols, pens = [], [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.repetition_penalty != 1.0 and h is not None:
            seen = sorted(h.prompt_ids | h.counts.keys())
            rows += [i] * len(seen)
            cols += seen
            pens += [p.repetition_penalty] * len(seen)
    if not rows:
        return
    idx = _index(rows, cols, out.device)
    pen = torch.tensor(pens, device=out.device)
    x = out[idx]
    out[idx] = torch.where(x > 0, x / pen, x * pen)


def _frequency_presence(out: torch.Tensor, params, histories) -> None:
    rows, cols, sub = [], [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        if (p.frequency_penalty or p.presence_penalty) and h is not None and h.counts:
            for tok, n in h.counts.items():
                rows.append(i), cols.append(tok), sub.append(p.frequency_penalty * n + p.presence_penalty)
    if rows:
        out.index_put_(_index(rows, cols, out.device), -torch.tensor(sub, device=out.device),
                       accumulate=True)
