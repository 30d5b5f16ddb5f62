"""`hasctl profile`'s gateway points: the host CPU the gateway spends preprocessing one request,
measured through the gateway's own code as it runs live.

For each modality and media size, a chat request body as `hasctl bench` sends it (media as a
data URI, `hasctl.workload.synthesize`) goes through `http_api.parse_chat` and
`GatewayCore.preprocess` of a gateway core built in this process, with its media decode pool:
JSON and request parsing, media decode (as the live gateway's pool does it: an image up to 4 M pixels in an idle
decode thread, anything else in a worker process) and the HF processor and tokenizer. The point is the CPU its "parse", "media" and "tokenize" phases charge to the
request (`HostAccount`, thread CPU time), the same figure the live gateway reports per request
in GET /trace, which bench/fidelity_replay.py sets against it. Each repeat has media of its
own, so the decode pool's cache never answers. Not included: the media content hash the
gateway's encoder-cache plan takes (it needs encode instances), a few hundred microseconds per MB.
"""
from __future__ import annotations

import asyncio
import json
import statistics

from easerve import profile_format as pf
from easerve.stages.encode import profiler as ep
from hasctl.profile_plan import Plan, sizes_of
from hasctl.workload import WorkloadSpec, synthesize

PHASES = ("parse", "media", "tokenize")  # the gateway's preprocessing phases (easerve/stages/common/host_time.py)


def spec_for(modality: str, size) -> WorkloadSpec:
    """The bench workload of one request of `modality` at the profile's `size`."""
    if modality == "image":
        return WorkloadSpec(modality="image", image_size=tuple(size))
    if modality == "video":
        frames, w, h = size
        return WorkloadSpec(modality="video", video_frames=frames, video_size=(w, h))
    if modality == "audio":
        return WorkloadSpec(modality="audio", audio_s=float(size))
    return WorkloadSpec(modality="text")


def bodies(modality: str, size, n: int, served: str) -> list[bytes]:
    """n request bodies of `modality` at `size`, each with media of its own."""
    return [json.dumps(synthesize(spec_for(modality, size), 1, seed=0, content_seed=k)[0].body(served)).encode()
            for k in range(n)]


async def preprocess_cpu(core, raw: bytes) -> dict[str, float]:
    """Host CPU seconds of the gateway's parse, media and tokenize phases for one request body
    (a phase the request did not go through is absent)."""
    from easerve.stages.common.host_time import HostAccount
    from easerve.stages.gateway.http_api import parse_chat
    acc = HostAccount()
    _, job = parse_chat(core, raw, acc)
    await core.preprocess(job)
    return {p: acc.seconds[p] for p in PHASES if p in acc.seconds}


def gateway_core(model: str, workers: int = 1):
    """A gateway core of `model` with its media decode pool (started by the caller, in a loop),
    built in this process and never started: no call leaves it."""
    from easerve.models.loader import load_adapter
    from easerve.stages.common.configs import GatewayConfig
    from easerve.stages.gateway.app import media_resolver
    from easerve.stages.gateway.core import GatewayCore
    from easerve.stages.gateway.metrics import GatewayMetrics
    nowhere = ("127.0.0.1:1",)
    cfg = GatewayConfig(model=model, prefill=nowhere, decode=nowhere, media_workers=workers)
    adapter = load_adapter(model, role="processor", device="cpu")
    return GatewayCore(cfg, adapter, GatewayMetrics(), media=media_resolver(cfg, adapter))


def measure_gateway(model: str, modalities: tuple[str, ...], plan: Plan) -> list[pf.GatewayPoint]:
    """One GatewayPoint per modality and media size of the plan, and one text-only."""
    async def run() -> list[pf.GatewayPoint]:
        core = gateway_core(model)
        await asyncio.to_thread(core.media.pool.start)
        out = []
        try:
            for mod in modalities + ("text",):
                for size in (None,) if mod == "text" else sizes_of(plan, mod):
                    raws = bodies(mod, size, plan.repeats + 1, core.cfg.served_model)
                    times = [sum((await preprocess_cpu(core, raw)).values()) for raw in raws][1:]  # 1st: warm-up
                    out.append(pf.GatewayPoint(mod, "" if size is None else ep.media_label(mod, size),
                                               statistics.median(times)))
        finally:
            core.media.pool.close()
        return out
    return asyncio.run(run())
