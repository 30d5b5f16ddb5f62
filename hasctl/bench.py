"""`hasctl bench`: an open-loop load client for any OpenAI-compatible chat endpoint.

Requests go out at their scheduled times (Poisson, or gamma with burstiness K; seeded; see
`hasctl.workload`) whether or not earlier ones have finished, as streamed
`/v1/chat/completions` calls (`stream: true`, `stream_options.include_usage`), in one asyncio
process. The client records, per request, the send time, the arrival of every content chunk,
the end and any error; `easerve.slo.compute_metrics` turns those records into the result
(field names of `vllm bench serve` where they overlap: `median_ttft_ms`, `p99_tpot_ms`,
`request_throughput`, `request_goodput`, ...). Request bodies are built before the clock starts,
so the sending loop only sleeps, posts and reads. With `max_concurrency` N (`--max-concurrency`, as
in `vllm bench serve`) at most N requests are in flight: a request due while N are open waits
for one to end (its send time is when it goes out); with a high rate that is a closed loop of N.

From Python (what `hasctl tune` calls):

    from hasctl.bench import BenchConfig, run_bench
    result = await run_bench(BenchConfig(url="http://127.0.0.1:8000", rate=4.0, num_requests=200,
                                         slo=SLO(ttft_ms=500, tpot_ms=50)))
    result.metrics["request_goodput"]; result.to_json()

`run_bench(config, requests=...)` replays given `ChatRequest`s instead of synthesizing them.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from easerve.slo import SLO, RequestRecord, compute_metrics
from hasctl.workload import ChatRequest, WorkloadSpec, arrival_times, load_dataset, parse_size, synthesize

FORMAT = "easerve.bench/v1"


@dataclass(frozen=True)
class BenchConfig:
    """One run. Exactly one of num_requests / duration_s bounds it; timeout_s bounds it hard
    (requests still open then are cancelled and count as errors of kind 'run_timeout')."""

    url: str
    rate: float = 1.0
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration_s: float | None = None
    seed: int = 0
    content_seed: int | None = None    # media and text of the synthetic requests (None: seed); arrivals stay seed's
    workload: WorkloadSpec = WorkloadSpec()
    dataset: str | None = None
    model: str | None = None           # None: the first id of GET /v1/models
    ignore_eos: bool = False
    slo: SLO | None = None
    request_timeout_s: float = 300.0
    timeout_s: float = 3600.0
    label: str = ""                    # deployment name for reports
    progress: bool = True
    max_concurrency: int | None = None  # at most this many requests in flight (None: no limit)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests (--requests) or duration_s (--duration)")
        for name in ("request_timeout_s", "timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds, got {v!r}")
        arrival_times(self.rate, self.burstiness, n=1)  # validates rate and burstiness
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency (--max-concurrency) must be >= 1, got {self.max_concurrency}")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slo"] = self.slo.to_dict() if self.slo else None
        return d


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    metrics: dict
    records: list[RequestRecord] = field(repr=False)
    max_send_lag_ms: float = 0.0       # how late the client sent its most delayed request
    client_cpu_s: float = 0.0          # CPU time this process spent during the open loop

    def to_dict(self) -> dict:
        c = self.config
        return {"format": FORMAT, "label": c.label, "model_id": self.model, "endpoint": c.endpoint,
                "modality": "dataset" if c.dataset else c.workload.modality,
                "request_rate": c.rate, "burstiness": c.burstiness, "num_prompts": len(self.records),
                **self.metrics, "max_send_lag_ms": self.max_send_lag_ms, "client_cpu_s": self.client_cpu_s,
                "slo": c.slo.to_dict() if c.slo else None, "config": c.to_dict(),
                **self._vllm_lists(), "records": [r.to_dict() for r in self.records]}

    def _vllm_lists(self) -> dict:
        """The per-request lists `vllm bench serve` saves (seconds; 0 / [] / "" for a failed request)."""
        rs = self.records
        return {"ttfts": [r.ttft_s if r.ok else 0.0 for r in rs], "itls": [r.itl_s if r.ok else [] for r in rs],
                "input_lens": [r.prompt_tokens or 0 for r in rs], "output_lens": [r.tokens if r.ok else 0 for r in rs],
                "errors": [r.error or "" for r in rs]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"


# ---- the client ----------------------------------------------------------------------------
async def run_bench(config: BenchConfig, requests: Sequence[ChatRequest] | None = None) -> BenchResult:
    """Run the workload against config.url and return the measured result."""
    import aiohttp

    times = arrival_times(config.rate, config.burstiness, config.seed,
                          n=config.num_requests, duration_s=config.duration_s)
    reqs = _requests(config, len(times), requests)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = config.model or await _first_model(session, config.url)
        bodies = [json.dumps(r.body(model, config.ignore_eos)).encode() for r in reqs]
        records = [RequestRecord(r.index, r.modality, t) for r, t in zip(reqs, times)]
        bar = _bar(config, len(records))
        cpu0 = time.process_time()
        try:
            await _open_loop(session, config, bodies, records, bar)
        finally:
            cpu = time.process_time() - cpu0
            if bar is not None:
                bar.close()
    lag = max((r.sent_s - r.scheduled_s for r in records if r.sent_s is not None), default=0.0)
    return BenchResult(config, model, compute_metrics(records, config.slo), records, lag * 1e3, cpu)


def _requests(config: BenchConfig, n: int, given: Sequence[ChatRequest] | None) -> list[ChatRequest]:
    if given is None and config.dataset:
        given = load_dataset(config.dataset, config.workload.output_tokens)
    if given is None:
        return synthesize(config.workload, n, config.seed, config.content_seed)
    if not given:
        raise ValueError("no requests to replay")
    return [ChatRequest(i, r.modality, r.messages, r.max_tokens) for i, r in
            ((i, given[i % len(given)]) for i in range(n))]  # cycle the dataset to the schedule


async def _first_model(session, url: str) -> str:
    import aiohttp

    base = url.rstrip("/").removesuffix("/chat/completions").removesuffix("/v1")
    try:
        async with session.get(base + "/v1/models") as resp:
            if resp.status != 200:
                raise ValueError(f"GET {base}/v1/models answered {resp.status}; pass --model NAME")
            data = (await resp.json()).get("data") or []
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach {base} ({type(e).__name__}: {e}); is the server up at --url?") from None
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model NAME")
    return data[0]["id"]


def _bar(config: BenchConfig, total: int):
    if not config.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=f"bench {config.rate:g} req/s", unit="req", file=sys.stderr,
                dynamic_ncols=True)


async def _open_loop(session, config: BenchConfig, bodies: list[bytes], records: list[RequestRecord],
                     bar) -> None:
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0  # noqa: E731 - the run's clock
    tasks: list[asyncio.Task] = []
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def limited(body: bytes, rec: RequestRecord) -> None:
        async with limit:
            await _one(session, config.endpoint, body, rec, clock, bar)

    async def schedule() -> None:
        for body, rec in zip(bodies, records):
            delay = rec.scheduled_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            one = _one(session, config.endpoint, body, rec, clock, bar) if limit is None else limited(body, rec)
            tasks.append(asyncio.create_task(one))
        await asyncio.gather(*tasks)

    try:
        await asyncio.wait_for(schedule(), timeout=config.timeout_s)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rec in records:
            if rec.sent_s is None:
                rec.error, rec.error_kind = f"not sent before the run's {config.timeout_s:g} s timeout", "run_timeout"


async def _one(session, url: str, body: bytes, rec: RequestRecord, clock, bar) -> None:
    import aiohttp

    rec.sent_s = clock()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                rec.error, rec.error_kind = f"HTTP {resp.status}: {text}", f"http_{resp.status}"
            else:
                await _read_stream(resp, rec, clock)
    except asyncio.CancelledError:
        rec.error, rec.error_kind = "still open when the run's timeout (--timeout) hit", "run_timeout"
        raise
    except asyncio.TimeoutError:
        rec.error, rec.error_kind = "request timed out (--request-timeout)", "timeout"
    except aiohttp.ClientError as e:
        rec.error, rec.error_kind = f"{type(e).__name__}: {e}", "connection"
    finally:
        rec.end_s = clock()
        if rec.error is None and not rec.chunk_s:
            rec.error, rec.error_kind = "the stream ended without any content", "no_tokens"
        if bar is not None:
            bar.update(1)


async def _read_stream(resp, rec: RequestRecord, clock) -> None:
    """Consume an SSE stream: a 'data: {json}' line per event, 'data: [DONE]' at the end."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        now = clock()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            rec.error, rec.error_kind = f"malformed SSE event: {data[:200]!r}", "stream"
            return
        if "error" in event:
            err = event["error"]
            rec.error, rec.error_kind = f"in-band error: {err}", "stream"
            return
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                rec.chunk_s.append(now)
        usage = event.get("usage")
        if usage:
            rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)


# ---- command line ----------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="open-loop load against an OpenAI-compatible chat endpoint")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    add_workload_args(p)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--timeout", type=float, default=3600.0, help="hard limit for the whole run (s)")
    p.add_argument("--label", default="", help="deployment name recorded for hasctl report")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most N requests in flight (as vllm bench serve's); with a high --rate, a closed loop")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="result JSON")
    p.set_defaults(func=run)


def add_workload_args(p) -> None:
    """The workload and SLO flags `hasctl bench` and `hasctl simulate` share."""
    p.add_argument("--modality", default="image", choices=["image", "video", "audio", "text", "mixed"])
    p.add_argument("--mix", default="image,video,audio,text", help="modalities 'mixed' draws from")
    p.add_argument("--rate", type=float, required=True, help="mean arrival rate, requests/s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape K (1 = Poisson, < 1 burstier)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--requests", type=int, default=None,
                       help="number of requests (default: 100, or each --dataset line once)")
    bound.add_argument("--duration", type=float, default=None, help="send for this many seconds instead")
    p.add_argument("--image-size", default="224x224", help="WxH of synthetic images")
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--video-size", default="112x112", help="WxH of synthetic video frames")
    p.add_argument("--video-format", default="gif", choices=["gif", "frames"])
    p.add_argument("--audio-s", type=float, default=2.0, help="seconds of synthetic audio")
    p.add_argument("--input-tokens", type=int, default=32, help="words of text per request (about tokens)")
    p.add_argument("--output-tokens", type=int, default=32, help="max_tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (exact lengths)")
    p.add_argument("--dataset", default=None, help="JSONL of requests to replay (see hasctl/workload.py)")
    p.add_argument("--slo", default=None, choices=["tight", "moderate", "loose"], help="tier from --profile")
    p.add_argument("--profile", default=None, help="profile file whose SLO tiers --slo names")
    p.add_argument("--ttft-ms", type=float, default=None)
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--content-seed", type=int, default=None,
                   help="seed of the synthetic media and text alone (default: --seed): a rerun against the same "
                        "server with the same arrivals but media its encoder and prefix caches have not seen")


def slo_from_args(args) -> SLO | None:
    explicit = args.ttft_ms is not None or args.tpot_ms is not None
    if args.slo and explicit:
        raise ValueError("give either --slo TIER --profile P or --ttft-ms/--tpot-ms, not both")
    if explicit:
        if args.ttft_ms is None or args.tpot_ms is None:
            raise ValueError("--ttft-ms and --tpot-ms go together; give both")
        return SLO(args.ttft_ms, args.tpot_ms, tier="custom")
    if args.slo:
        if not args.profile:
            raise ValueError(f"--slo {args.slo} reads its limits from a profile; add --profile PROFILE.json")
        from easerve.profile_format import load
        return load(args.profile).slo(args.slo)
    return None


def workload_from_args(args) -> WorkloadSpec:
    return WorkloadSpec(modality=args.modality, image_size=parse_size(args.image_size),
                        video_frames=args.video_frames, video_size=parse_size(args.video_size, "--video-size"),
                        video_format=args.video_format, audio_s=args.audio_s, input_tokens=args.input_tokens,
                        output_tokens=args.output_tokens, mix=tuple(m for m in args.mix.split(",") if m))


def count_from_args(args) -> int | None:
    """--requests (default 100, or each --dataset line once); None with --duration."""
    if args.duration is not None:
        return None
    if args.requests is None and args.dataset:
        return len(load_dataset(args.dataset))
    return args.requests or 100


def config_from_args(args) -> BenchConfig:
    spec, n = workload_from_args(args), count_from_args(args)
    return BenchConfig(url=args.url, rate=args.rate, burstiness=args.burstiness, num_requests=n,
                       duration_s=args.duration, seed=args.seed, workload=spec, dataset=args.dataset,
                       content_seed=args.content_seed, model=args.model, ignore_eos=args.ignore_eos, slo=slo_from_args(args),
                       request_timeout_s=args.request_timeout, timeout_s=args.timeout, label=args.label,
                       progress=not args.no_progress, max_concurrency=getattr(args, "max_concurrency", None))


def run(args) -> int:
    config = config_from_args(args)
    result = asyncio.run(run_bench(config))
    Path(args.out).write_text(result.to_json())
    print(summary(result.metrics), flush=True)
    return 0


def summary(m: dict) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"
    lines = [f"completed {m['completed']} failed {m['failed']} in {m['duration']:.2f} s"
             + (f"  errors {m['errors_by_kind']}" if m["errors_by_kind"] else ""),
             f"request_throughput {f(m['request_throughput'])} req/s  output_throughput "
             f"{f(m['output_throughput'])} tok/s  request_goodput {f(m['request_goodput'])} req/s  "
             f"slo_attainment {f(m['slo_attainment'])}"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"{name:>5} ms  mean {f(m[f'mean_{name}_ms'])}  p50 {f(m[f'p50_{name}_ms'])}  "
                     f"p90 {f(m[f'p90_{name}_ms'])}  p99 {f(m[f'p99_{name}_ms'])}")
    return "\n".join(lines)
