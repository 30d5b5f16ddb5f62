"""Log-probabilities of sampled tokens, and the most likely alternatives, for the requests
that ask for them (`SamplingParams.logprobs`).

They are the model's raw distribution: log_softmax of the logits before temperature,
top-k or top-p (what vLLM returns by default), so they do not depend on how the token was
drawn. Prefill computes them for the first token and the decode engine for the others.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                          # of the token that was chosen
    top: tuple[tuple[int, float], ...] = () # (token id, logprob), most likely first

    def to_proto(self, msg) -> None:
        msg.logprob = self.logprob
        msg.top_ids.extend(t for t, _ in self.top)
        msg.top_logprobs.extend(lp for _, lp in self.top)

    @classmethod
    def from_proto(cls, msg) -> "TokenLogprobs":
        return cls(float(msg.logprob), tuple(zip((int(t) for t in msg.top_ids), (float(x) for x in msg.top_logprobs))))


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[TokenLogprobs | None]:
    """logits [B, V], the token chosen in each row, each row's k (None: not asked) -> one
    TokenLogprobs per row (None where not asked). Only the rows that ask are computed."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))[:, 0].tolist()
    kmax = max(ks[i] for i in rows)
    top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (None, None))
    for j, i in enumerate(rows):
        k = ks[i]
        top = tuple(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else ()
        out[i] = TokenLogprobs(chosen[j], top)
    return out
