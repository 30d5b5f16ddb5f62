"""Each stage's settings as one frozen dataclass; its command line is generated from it.

A field declared with `opt` becomes the flag `--field-name` (underscores to dashes) with the
field's type and default and the help text in its metadata; `bool` fields are bare switches,
tuple fields are comma-separated lists, `Literal` fields take one of their values. A field's
bounds are part of its type (easerve.fields); the choices are the owners' own Literals (the
batcher's modes, the transports, the SM backends, the partition policies). The decode engine's
flags are `EngineConfig`'s fields, and the encode batcher's and partitioner's configs are built
from the encode flags (`EncodeConfig.batcher`, `.partitioner`), so each bound is stated once.
The command lines are built from these fields in `easerve.stages.common.argv`. So the
services, the deployment file and `hasctl` cannot drift apart.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Literal

from pydantic import Field

from easerve.engine.config import DEVICE_HELP, EngineConfig
from easerve.fields import (Addresses, Device, Fraction, HostPort, NonNegFloat, NonNegInt, PosFloat, PosInt,
                            check_fields, flags_for, opt, torch_device)
from easerve.partition.backends import Preference
from easerve.policy.admission import AdmissionMode, Priority, TierName
from easerve.policy.batcher import BatchMode, BatcherConfig
from easerve.policy.online import OnlineBounds, OnlineConfig
from easerve.policy.partitioner import PartitionerConfig, Policy
from easerve.rpc.tls import check_tls_flags
from easerve.stages.decode.stream_interval import DEFAULT_STREAM_INTERVAL_MS, MAX_STREAM_INTERVAL_MS
from easerve.transport import EmbedTransportKind, KVTransportKind

StreamIntervalMs = Annotated[float, Field(ge=0, le=MAX_STREAM_INTERVAL_MS, allow_inf_nan=False)]

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
_BATCHER, _PARTITIONER = BatcherConfig(), PartitionerConfig()  # their defaults are the flags'


@dataclass(frozen=True)
class StageConfig:
    model: str = opt("", "checkpoint folder or hub id ORG/NAME[@REVISION] (a supported family; a hub id is "
                     "fetched with only the files this stage loads: easerve.models.hub)", wired=True)
    device: Device = opt("cpu", DEVICE_HELP, wired=True)
    listen: HostPort = opt("127.0.0.1:0", "gRPC address to bind, host:port (port 0 = any)", wired=True)
    port_file: str = opt("", "write the bound gRPC port to this file", wired=True)
    drain_timeout_s: NonNegFloat = opt(600.0, "on SIGTERM: the longest wait for the calls accepted before it (each "
                                       "ends by its own deadline first); calls still open then end UNAVAILABLE")
    grace_s: NonNegFloat = opt(10.0, "after the drain: seconds for the streams that are not work (health "
                               "watches) before the server closes")
    threads: NonNegInt = opt(0, "torch intra-op threads (0: one per core of --device, else torch's default)",
                             note="0 = automatic")
    dtype: Dtype = opt("auto", "weights dtype; auto = float32 on CPU, bfloat16 on GPU")
    log_level: str = opt("INFO", "logging level")
    metrics_listen: str = opt("", "host:port for GET /metrics (Prometheus); encode adds /trace, /partition")
    max_message_mb: Annotated[float, Field(ge=4)] = opt(
        256.0, "largest gRPC message this process receives or sends, MiB (>= 4); "
        "a bigger one is refused with RESOURCE_EXHAUSTED 'larger than max'", note="MiB")
    tls_cert: str = opt("", "PEM certificate: serve TLS (gRPC; the gateway's HTTP too) and call peers over TLS")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt("", "PEM CA bundle that verifies the peers called (and clients, with --tls-client-auth); "
                      "empty: the system's roots")
    tls_client_auth: bool = opt(False, "mutual TLS: refuse clients without a certificate signed by --tls-ca")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model is required: a checkpoint folder or a hub id ORG/NAME[@REVISION]")
        check_fields(self)
        check_tls_flags(self.tls_cert, self.tls_key, self.tls_ca, self.tls_client_auth)
        self._check()

    def _check(self) -> None:
        """What a stage requires across its fields (each field's bounds are its type's)."""

    @property
    def torch_device(self) -> str:
        return torch_device(self.device)

    @property
    def model_roles(self) -> tuple[str, ...]:
        """The adapter roles (easerve.models.loader.load_adapter) this stage loads: what a launcher
        fetches of a hub id for it."""
        return ("processor",)


@dataclass(frozen=True)
class RendezvousFields:
    """A stage that receives over NCCL pair groups (decode: KV from prefill; prefill:
    embeddings from encode); where its store listens is easerve.stages.common.rendezvous."""
    kv_rendezvous: str = opt("", "host:port of the store where the senders to this instance (prefill for decode's "
                                 "KV, encode for prefill's embeddings) form NCCL pair groups with it (default: on a "
                                 "CUDA device listening beyond loopback, the --listen host, any port; otherwise "
                                 "none; off: none)")


@dataclass(frozen=True)
class StreamFields:
    """How the Decode service streams a request's tokens (easerve.stages.decode.stream_interval)."""
    stream_interval_ms: StreamIntervalMs = opt(
        DEFAULT_STREAM_INTERVAL_MS, "send a stream's tokens at most this often, held tokens together in one "
        "message (0: each token as it comes); the first token and the last are never held, a held one waits at "
        "most this plus one decode step; it saves a gRPC write on decode and a read on the gateway per token held")


@dataclass(frozen=True)
class DecodeConfig(EngineConfig, StreamFields, RendezvousFields, StageConfig):
    """The decode stage: its engine flags are EngineConfig's fields; the engine takes it as is."""

    def __post_init__(self) -> None:
        StageConfig.__post_init__(self)

    def _check(self) -> None:
        self._check_engine()

    @property
    def model_roles(self) -> tuple[str, ...]:
        return ("decode",)


@dataclass(frozen=True)
class PeerFields:
    """How a stage that calls others follows their instances as they come and go
    (easerve.stages.common.peer_sources): its peer flags may name hosts (every address a name
    resolves to is one instance, looked up again), and the launcher may keep a peers file."""
    peers_file: str = opt("", "the launcher's list of peers, JSON {\"decode\": [\"host:port\", ...], ...}; "
                          "read again when it changes, a role it lists replaces that flag", wired=True)
    peer_refresh_s: PosFloat = opt(5.0, "look peer host names up again every this many seconds (DNS: e.g. a "
                                        "Kubernetes headless Service's instances)")


@dataclass(frozen=True)
class PrefillFields(PeerFields):
    """Prefill as a stage (remote prefill, and the one co-located in encode)."""
    decode: Addresses = opt((), "decode instances this prefill may hand KV to, host:port,...", wired=True)
    kv_transport: KVTransportKind = opt("auto", "KV transport to decode (auto: by node identity)")
    max_batched_tokens: PosInt = opt(2048, "prefill batch token budget (like vLLM's max_num_batched_tokens)")
    max_prefill_batch: PosInt = opt(16, "most requests in one prefill forward")
    max_inflight: PosInt = opt(512, "past this many requests in flight: RESOURCE_EXHAUSTED")
    no_prefix_cache: bool = opt(False, "turn prefix caching off (on by default: prefill keeps the KV of computed "
                                "prompts in blocks and computes only what a later prompt adds)")
    prefix_cache_gb: NonNegFloat = opt(1.0, "prefix cache: GB of KV blocks held (LRU of unreferenced blocks, on "
                                       "the prefill device)")
    prefix_block_tokens: PosInt = opt(16, "prefix cache: tokens per block (a hit is a whole number of blocks)")

    @property
    def prefix_cache(self):
        """The prefix cache's config from these flags, or None when it is off."""
        from easerve.cache.prefix import PrefixCacheConfig
        if self.no_prefix_cache or self.prefix_cache_gb == 0:
            return None
        return PrefixCacheConfig(block_tokens=self.prefix_block_tokens, budget_bytes=int(self.prefix_cache_gb * 2**30))


@dataclass(frozen=True)
class PrefillConfig(PrefillFields, RendezvousFields, StageConfig):
    def _check(self) -> None:
        if not self.decode:
            raise ValueError("prefill needs --decode addresses for its KV")

    @property
    def model_roles(self) -> tuple[str, ...]:
        return ("prefill",)


@dataclass(frozen=True)
class EncodeConfig(PrefillFields, StageConfig):
    prefill: Addresses = opt((), "remote prefill instances, host:port,...", wired=True)
    colocate_prefill: bool = opt(False, "run a prefill in this process, on this device")
    remote_fraction: Fraction = opt(1.0, "s: share of requests sent to remote prefill", note="s")
    embed_transport: EmbedTransportKind = opt("auto", "how embeddings reach remote prefill: auto = by node identity "
                                              "(shared memory on one host, CUDA IPC on one GPU, NCCL between GPUs "
                                              "to a prefill with --kv-rendezvous; inline in the message where none "
                                              "reaches), or one of them forced")
    max_batch: int = opt(_BATCHER.max_batch, "B: most requests per encode batch")
    batch_mode: BatchMode = opt(_BATCHER.mode, "encode batching: adaptive (size, arrival gap, cap), fixed (size, "
                                "cap), request_at_a_time (one at a time), continuous (a free encoder takes all "
                                "pending at once); in every mode arrivals wait while the encoder is busy")
    safety_cap_s: float = opt(_BATCHER.safety_cap_s, "longest a request waits for a batch")
    gap_coef: float = opt(_BATCHER.gap_coef, "gap threshold = gap_coef / lambda")
    max_gap_s: float = opt(0.05, "ceiling of the gap threshold")
    sm_backend: Preference = opt("auto", "how co-located prefill shares the device: auto = the best mechanism "
                                 "here (time-slicing, reported as degraded, when there is none); a named one fails "
                                 "the start when unavailable; static = a fixed 50/50 split")
    partition_policy: Policy = opt(_PARTITIONER.policy, "SM partition policy: dynamic (per batch, from the "
                                   "profile), static (exactly 50/50), timeslice (no partition)")
    partition_profile: str = opt("", "partition profile file: loaded if present, else written")
    profile_batch_sizes: str = opt("1,2,4,8", "batch sizes the partition profile measures")
    partition_tolerance: float = opt(_PARTITIONER.tolerance, "share kept: encode within this of its exclusive "
                                     "latency")
    encoder_cache_gb: NonNegFloat = opt(1.0, "encoder-output cache: GB of embeddings held (LRU by bytes, on the "
                                        "encode device) for media seen again; 0 turns it off",
                                        note="0 turns the cache off")
    online: bool = opt(False, "online controller: re-tune B, s and the partition tolerance from sliding-window "
                       "load estimates (within the --online-* bounds), log each change with its reason, export "
                       "easerve:online_changes_total and easerve:desired_instances")
    online_batch: str = opt("1:32", "MIN:MAX bounds of B for --online")
    online_remote_fraction: str = opt("0:1", "MIN:MAX bounds of s for --online (with --colocate-prefill)")
    online_tolerance: str = opt("0:0.5", "MIN:MAX bounds of the partition tolerance for --online")
    online_instances: str = opt("1:1", "MIN:MAX instances per stage easerve:desired_instances may ask for")
    online_instances_file: str = opt("", "JSON {stage: instances} kept by the launcher (hasctl up --autoscale): "
                                     "how many encode instances share the load, for --online's desired count")
    online_util: str = opt("0.4:0.7:0.85", "LOW:TARGET:HIGH utilization of --online: B grows and instances are "
                           "added above HIGH, B shrinks and instances go below LOW, a stage is sized for TARGET")
    online_window_s: PosFloat = opt(20.0, "sliding window of --online's estimates (seconds)")
    online_dwell_s: PosFloat = opt(30.0, "--online changes a knob at most once per this many seconds")

    @cached_property
    def online_config(self) -> OnlineConfig:
        """The online controller's config, from the --online-* flags."""
        def pair(flag: str, value: str, kind):
            try:
                lo, hi = (kind(x) for x in value.split(":"))
            except ValueError:
                raise ValueError(f"--{flag} must be MIN:MAX, got {value!r}") from None
            return lo, hi
        (b0, b1), (s0, s1) = pair("online-batch", self.online_batch, int), \
            pair("online-remote-fraction", self.online_remote_fraction, float)
        (t0, t1), (n0, n1) = pair("online-tolerance", self.online_tolerance, float), \
            pair("online-instances", self.online_instances, int)
        try:
            low, target, high = (float(x) for x in self.online_util.split(":"))
        except ValueError:
            raise ValueError(f"--online-util must be LOW:TARGET:HIGH, got {self.online_util!r}") from None
        with flags_for(min_batch="--online-batch", max_batch="--online-batch",
                       min_remote_fraction="--online-remote-fraction", max_remote_fraction="--online-remote-fraction",
                       min_tolerance="--online-tolerance", max_tolerance="--online-tolerance",
                       min_instances="--online-instances", max_instances="--online-instances",
                       window_s="--online-window-s", dwell_s="--online-dwell-s", low_util="--online-util",
                       target_util="--online-util", high_util="--online-util"):
            bounds = OnlineBounds(b0, b1, s0, s1, t0, t1, n0, n1)
            return OnlineConfig(bounds=bounds, window_s=self.online_window_s, dwell_s=self.online_dwell_s,
                                reversal_dwell_s=4 * self.online_dwell_s, colocated=self.colocate_prefill,
                                low_util=low, target_util=target, high_util=high)

    @cached_property
    def batcher(self) -> BatcherConfig:
        """The encode batcher's config, from these flags (its bounds are BatcherConfig's)."""
        with flags_for(max_batch="--max-batch", mode="--batch-mode", safety_cap_s="--safety-cap-s",
                       gap_coef="--gap-coef", max_gap_s="--max-gap-s"):
            return BatcherConfig(max_batch=self.max_batch, mode=self.batch_mode, safety_cap_s=self.safety_cap_s,
                                 gap_coef=self.gap_coef, max_gap_s=min(self.max_gap_s, self.safety_cap_s))

    @cached_property
    def partitioner(self) -> PartitionerConfig:
        """The SM partitioner's config, from these flags (its bounds are PartitionerConfig's)."""
        with flags_for(policy="--partition-policy", tolerance="--partition-tolerance"):
            return PartitionerConfig(policy=self.partition_policy, tolerance=self.partition_tolerance)

    def _check(self) -> None:
        self.batcher, self.partitioner, self.online_config  # built now: a bad flag fails the parse
        if self.batch_mode == "request_at_a_time" and self.max_batch != 1:
            raise ValueError(f"--batch-mode request_at_a_time takes --max-batch 1, got {self.max_batch}")
        if not self.colocate_prefill and not self.prefill:
            raise ValueError("encode needs --colocate-prefill or --prefill addresses")
        if self.colocate_prefill and not self.decode and type(self) is EncodeConfig:
            raise ValueError("--colocate-prefill needs --decode addresses for its KV")
        if self.remote_fraction < 1.0 and not self.colocate_prefill:
            raise ValueError(f"--remote-fraction {self.remote_fraction} < 1 sends requests to a local "
                             "prefill; add --colocate-prefill or set it to 1.0")
        contra = {("static", "timeslice"), ("timeslice", "static")}
        if (self.partition_policy, self.sm_backend) in contra:
            raise ValueError(f"--partition-policy {self.partition_policy} contradicts --sm-backend {self.sm_backend}: "
                             "drop one (--sm-backend static is the 50/50 split, timeslice none)")

    @property
    def model_roles(self) -> tuple[str, ...]:
        return ("encode", "prefill") if self.colocate_prefill else ("encode",)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(x) for x in self.profile_batch_sizes.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--profile-batch-sizes must be comma-separated ints, got "
                             f"{self.profile_batch_sizes!r}") from None
        return sizes


@dataclass(frozen=True)
class MonolithConfig(EngineConfig, StreamFields, EncodeConfig):
    """Encode, prefill and decode in one process (the aggregated, vLLM-like baseline): it
    serves the Encode, Prefill and Decode services on one port; KV stays in-process."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "colocate_prefill", True)
        object.__setattr__(self, "remote_fraction", 0.0)
        StageConfig.__post_init__(self)

    def _check(self) -> None:
        EncodeConfig._check(self)
        self._check_engine()
        if self.online:
            raise ValueError("--online runs in the encode service only; drop it from the monolith")


@dataclass(frozen=True)
class GatewayConfig(PeerFields, StageConfig):
    listen: HostPort = opt("127.0.0.1:50051", "gRPC address to bind (the public SDK API)", wired=True)
    http_listen: str = opt("127.0.0.1:8000", "OpenAI-compatible HTTP address", wired=True)
    http_port_file: str = opt("", "write the bound HTTP port here", wired=True)
    encode: Addresses = opt((), "encode instances, host:port,...", wired=True)
    prefill: Addresses = opt((), "prefill instances for text-only requests, host:port,...", wired=True)
    decode: Addresses = opt((), "decode instances (reservations; tokens stream from them)", wired=True)
    served_model_name: str = opt("", "model id clients send (default: a hub id's ORG/NAME, else the folder's name)")
    request_timeout_s: PosFloat = opt(600.0, "default deadline of a request, seconds")
    default_max_tokens: PosInt = opt(256, "max_tokens when a request sets none")
    migration_limit: NonNegInt = opt(3, "times a request streaming from a decode instance that dies or stalls is "
                                     "moved to another one (its prompt and the tokens sent re-prefilled, the "
                                     "stream resumed where it stopped); 0: the request fails UNAVAILABLE instead")
    decode_progress_timeout_s: PosFloat = opt(30.0, "a decode stream with no token for this long has stalled: "
                                              "its request migrates (--migration-limit)")
    max_body_mb: float = opt(64.0, "largest HTTP request body")
    max_model_len: int = opt(0, "prompt + max_tokens limit (0: the model's, capped at 4096 like decode)")
    max_inflight: PosInt = opt(1024, "past this many requests: 429 / RESOURCE_EXHAUSTED")
    preprocess_threads: PosInt = opt(2, "threads for chat templates, tokenization and media")
    allowed_media_domains: tuple[str, ...] = opt((), "hosts media URLs may name (*.example.com for subdomains); "
                                                 "empty: any public host. Private / loopback addresses are "
                                                 "refused unless their host is listed here")
    allowed_local_media_path: str = opt("", "serve file:// media URLs from below this folder (empty: refused)")
    media_max_mb: float = opt(64.0, "largest media file fetched by URL, MB")
    media_timeout_s: float = opt(10.0, "time limit of one media URL fetch")
    media_max_mpixels: float = opt(256.0, "decoded pixels per request (all images and video frames), millions")
    media_workers: NonNegInt = opt(0, "worker processes decoding media files (0: one per core the gateway may run "
                                      "on); images of at most 4 megapixels are decoded in the gateway's own decode "
                                      "threads (one per core) while one is idle; a decoded array of 16 MiB or more "
                                      "comes back through /dev/shm")
    media_queue: NonNegInt = opt(0, "media files decoding or waiting at once; past it: 429 / RESOURCE_EXHAUSTED "
                                 "(0: 16 per media worker, at least 64)")
    media_hash_entries: NonNegInt = opt(65536, "media content hashes remembered (hash -> the encode instance sent it, "
                                  "and the item's prompt metadata) for encoder-cache-aware placement and "
                                  "pixel-free requests that skip preprocessing; 0: no hashing")
    encoder_cache_affinity: NonNegInt = opt(4, "send a request to the encode instance holding its media unless that "
                                      "instance has this many more calls open than the least loaded one")
    api_key: tuple[str, ...] = opt((), "API keys clients must send (HTTP Authorization: Bearer KEY, gRPC "
                                   "metadata authorization); repeatable or comma-separated, default "
                                   "$EASERVE_API_KEY; empty (and no --api-key-file): no keys asked. Not for "
                                   "deployment files (keys on a command line show in ps): use --api-key-file",
                                   repeat=True, secret=True, wired=True)
    api_key_file: str = opt("", "file of API keys, one a line (# comments); adds to --api-key")
    admission: AdmissionMode = opt(
        "off", "SLO-aware admission of a request predicted (from --profile and the stages' load) to miss its "
        "SLO tier: reject (429 / RESOURCE_EXHAUSTED with Retry-After) or admit it as best-effort; off: admit all")
    slo_tier: TierName = opt(
        "moderate", "default SLO tier of a request (the profile's tiers); per request: body field slo_tier, "
        "HTTP header / gRPC metadata x-easerve-slo-tier")
    priority: Priority = opt(
        "interactive", "default priority class; per request: body field priority, header / metadata "
        "x-easerve-priority")
    profile: str = opt("", "easerve.profile/v1 file (hasctl profile) of this deployment: the latency predictor's "
                       "service times and the SLO tiers; with it, predicted and actual TTFT are exported "
                       "(metrics, GET /trace) even with --admission off")
    admission_probe_s: NonNegFloat = opt(
        1.0, "with --admission reject: after this many seconds in which every request was refused, admit the "
        "next one as a probe whose actual latency resets the calibration (0: never; a correction learned in "
        "an overload could then refuse every later request)")
    admission_encode_batch: PosInt = opt(8, "the encode instances' --max-batch, for the latency predictor")
    admission_prefill_tokens: PosInt = opt(2048, "the prefill instances' --max-batched-tokens, for the latency "
                                           "predictor")
    no_admission_calibration: bool = opt(False, "predict from the profile and the stages' pace alone (by default "
                                         "the predictor is also scaled by what admitted requests actually got: "
                                         "easerve/policy/calibration.py)")

    def _check(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the gateway needs --prefill and --decode addresses")
        if self.admission != "off" and not self.profile:
            raise ValueError(f"--admission {self.admission} needs --profile (a hasctl profile file of this "
                             "deployment); set it or use --admission off")

    @property
    def served_model(self) -> str:
        """The model id clients send: --served-model-name, else a hub id's ORG/NAME or the checkpoint
        folder's name."""
        from easerve.models.hub import served_name
        return self.served_model_name or served_name(self.model)


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "decode": DecodeConfig, "prefill": PrefillConfig, "encode": EncodeConfig,
    "monolith": MonolithConfig, "gateway": GatewayConfig,
}
