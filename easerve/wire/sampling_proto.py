"""SamplingParams <-> `easerve.v1.SamplingParams` and Timings <-> `easerve.v1.Timings`, torch-free
(the SDK uses them too).

`easerve.wire.protoconv` re-exports the sampling functions with the rest of the proto <-> domain conversions.
"""
from __future__ import annotations

from dataclasses import fields

from easerve.types import SamplingParams, StructuredOutput, Timings
from easerve.wire.v1 import common_pb2 as cpb


def sampling_to_proto(sp: SamplingParams) -> cpb.SamplingParams:
    msg = cpb.SamplingParams(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, min_p=sp.min_p, min_tokens=sp.min_tokens,
        logit_bias=dict(sp.logit_bias), n=sp.n, resumed=list(sp.resumed))
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.structured is not None:
        msg.structured.kind, msg.structured.spec = sp.structured.kind, sp.structured.spec
    return msg


def sampling_from_proto(msg, *, default_max_tokens: int = 16) -> SamplingParams:
    """Proto -> SamplingParams; unset max_tokens / top_p / repetition_penalty / n take defaults
    (floats rounded to 6 digits: float32 on the wire). ValueError if invalid."""
    return SamplingParams(
        max_tokens=msg.max_tokens or default_max_tokens, temperature=round(msg.temperature, 6),
        top_p=round(msg.top_p, 6) if msg.top_p else 1.0, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=round(msg.presence_penalty, 6), frequency_penalty=round(msg.frequency_penalty, 6),
        repetition_penalty=round(msg.repetition_penalty, 6) if msg.repetition_penalty else 1.0,
        min_p=round(msg.min_p, 6), min_tokens=msg.min_tokens,
        logit_bias={int(k): round(v, 6) for k, v in msg.logit_bias.items()},
        structured=(StructuredOutput(msg.structured.kind, msg.structured.spec)
                    if msg.HasField("structured") else None), n=msg.n or 1,
        resumed=tuple(msg.resumed))


def timings_from_proto(msg: cpb.Timings) -> Timings:
    return Timings(**{f.name: getattr(msg, f.name) for f in fields(Timings)})


def timings_to_proto(t: Timings, msg: cpb.Timings) -> None:
    """Write `t` into `msg` (a message's `timings` field)."""
    for f in fields(Timings):
        setattr(msg, f.name, getattr(t, f.name))
