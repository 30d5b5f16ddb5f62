"""Each stage's settings as one frozen dataclass; its command line is generated from it.

A field becomes the flag `--field-name` (underscores to dashes) with the field's type and
default and the help text in its metadata; `bool` fields are bare switches, tuple fields
are comma-separated lists. `parser(cls)` builds the argparse parser, `from_argv(cls, argv)`
the config (its `__post_init__` raising ValueError with what to change), and
`tunable_flags(stage)` lists the flags a deployment file may set (the rest, marked
`wired`, are peer addresses and ports that the launcher sets itself). So the services,
the deployment file and `hasctl` cannot drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from easerve.policy.batcher import MODES as BATCH_MODES
from easerve.rpc.tls import check_tls_flags

DEFAULT_MAX_MODEL_LEN = 4096  # default per-request token limit (prompt + max_tokens) of a deployment
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_TRANSPORTS = ("auto", "inline", "shm", "grpc", "cuda_ipc")
SM_BACKENDS = ("auto", "green_contexts", "mps", "cpu_affinity", "timeslice", "static")
PARTITION_POLICIES = ("dynamic", "static", "timeslice")
_DEVICE = re.compile(r"^(cpu(:\d+(-\d+)?(,\d+(-\d+)?)*)?|cuda(:\d+)?)$")


def opt(default: Any = dataclasses.MISSING, help: str = "", *, wired: bool = False,
        choices: tuple[str, ...] | None = None, repeat: bool = False, secret: bool = False):
    """A config field with its flag help; `wired`: set by the launcher, not by a deployment;
    `repeat`: a tuple flag that may also be given several times; `secret`: kept out of repr."""
    return field(default=default, repr=not secret,
                 metadata={"help": help, "wired": wired, "choices": choices, "repeat": repeat})


def _addrs(value: tuple[str, ...], flag: str) -> None:
    for a in value:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--{flag}: address {a!r} must be host:port")


def check_device(device: str) -> None:
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"device must be 'cpu', 'cpu:0-3' (those cores), 'cuda' or 'cuda:N', got {device!r}")


def cpu_cores(device: str) -> tuple[int, ...] | None:
    """The cores of a 'cpu:0-1,4' device, or None for plain 'cpu' / a GPU."""
    if not device.startswith("cpu:"):
        return None
    cores: list[int] = []
    for part in device[4:].split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return tuple(sorted(set(cores)))


def torch_device(device: str) -> str:
    """What torch calls the device: 'cpu:0-1' is 'cpu'."""
    return "cpu" if device.startswith("cpu") else device


@dataclass(frozen=True)
class StageConfig:
    model: str = opt("", "checkpoint folder (a supported family)", wired=True)
    device: str = opt("cpu", "cpu, cpu:0-3 (pinned to those cores), cuda or cuda:N", wired=True)
    listen: str = opt("127.0.0.1:0", "gRPC address to bind, host:port (port 0 = any)", wired=True)
    port_file: str = opt("", "write the bound gRPC port to this file", wired=True)
    grace_s: float = opt(10.0, "drain time on SIGTERM, seconds")
    threads: int = opt(0, "torch intra-op threads (0: one per core of --device, else torch's default)")
    dtype: str = opt("auto", "weights dtype; auto = float32 on CPU, bfloat16 on GPU", choices=DTYPES)
    log_level: str = opt("INFO", "logging level")
    metrics_listen: str = opt("", "host:port for GET /metrics (Prometheus); encode adds /trace, /partition")
    max_message_mb: float = opt(256.0, "largest gRPC message this process receives or sends, MiB (>= 4); "
                                "a bigger one is refused with RESOURCE_EXHAUSTED 'larger than max'")
    tls_cert: str = opt("", "PEM certificate: serve TLS (gRPC; the gateway's HTTP too) and call peers over TLS")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt("", "PEM CA bundle that verifies the peers called (and clients, with --tls-client-auth); "
                      "empty: the system's roots")
    tls_client_auth: bool = opt(False, "mutual TLS: refuse clients without a certificate signed by --tls-ca")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model is required: a checkpoint folder")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"--{_flag(f.name)} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, f.name)!r}")
        check_device(self.device)
        if self.grace_s < 0:
            raise ValueError(f"--grace-s must be >= 0, got {self.grace_s}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0 = automatic), got {self.threads}")
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen must be host:port, got {self.listen!r}")
        if not self.max_message_mb >= 4:
            raise ValueError(f"--max-message-mb must be >= 4 (MiB), got {self.max_message_mb}")
        check_tls_flags(self.tls_cert, self.tls_key, self.tls_ca, self.tls_client_auth)

    @property
    def torch_device(self) -> str:
        return torch_device(self.device)


@dataclass(frozen=True)
class EngineFields:
    """The decode engine's knobs (decode, and a monolith that decodes in-process)."""
    max_running: int = opt(64, "requests decoded together per step")
    max_waiting: int = opt(256, "admission queue; past it RESOURCE_EXHAUSTED")
    kv_cache_memory_gb: float = opt(0.0, "KV pool size in GiB (0: on cpu 2 GiB, at most a quarter of RAM); "
                                         "never more than --max-running requests of --max-seq-len need")
    gpu_memory_utilization: float = opt(0.9, "on cuda, without --kv-cache-memory-gb: the fraction of the "
                                             "device's memory this process may use (weights + KV), as vLLM's")
    num_slots: int = opt(0, "fixed KV slots of --max-seq-len instead of sizing from memory (0: from memory)")
    max_seq_len: int = opt(0, "tokens per request (0 = the model's context, capped at 4096)")
    kv_capacity_tokens: int = opt(0, "fixed paged KV pool size in tokens instead of memory (0: from memory)")
    block_size: int = opt(16, "tokens per KV block (paged layout)")


@dataclass(frozen=True)
class DecodeConfig(EngineFields, StageConfig):
    def __post_init__(self) -> None:
        StageConfig.__post_init__(self)
        _check_engine(self)


def _check_engine(c) -> None:
    for name in ("max_running", "block_size"):
        if getattr(c, name) < 1:
            raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(c, name)}")
    for name in ("max_waiting", "num_slots", "max_seq_len", "kv_capacity_tokens", "kv_cache_memory_gb"):
        if getattr(c, name) < 0:
            raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(c, name)}")
    if not 0.0 < c.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}")


@dataclass(frozen=True)
class PeerFields:
    """How a stage that calls others follows their instances as they come and go
    (easerve.stages.common.peer_sources): its peer flags may name hosts (every address a name
    resolves to is one instance, looked up again), and the launcher may keep a peers file."""
    peers_file: str = opt("", "the launcher's list of peers, JSON {\"decode\": [\"host:port\", ...], ...}; "
                          "read again when it changes, a role it lists replaces that flag", wired=True)
    peer_refresh_s: float = opt(5.0, "look peer host names up again every this many seconds (DNS: e.g. a "
                                     "Kubernetes headless Service's instances)")


def _check_peers(c) -> None:
    if not c.peer_refresh_s > 0:
        raise ValueError(f"--peer-refresh-s must be > 0, got {c.peer_refresh_s}")


@dataclass(frozen=True)
class PrefillFields(PeerFields):
    """Prefill as a stage (remote prefill, and the one co-located in encode)."""
    decode: tuple[str, ...] = opt((), "decode instances this prefill may hand KV to, host:port,...", wired=True)
    kv_transport: str = opt("auto", "KV transport to decode (auto: by node identity)", choices=KV_TRANSPORTS)
    max_batched_tokens: int = opt(2048, "prefill batch token budget (like vLLM's max_num_batched_tokens)")
    max_prefill_batch: int = opt(16, "most requests in one prefill forward")
    max_inflight: int = opt(512, "past this many requests in flight: RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class PrefillConfig(PrefillFields, StageConfig):
    def __post_init__(self) -> None:
        StageConfig.__post_init__(self)
        _check_prefill(self)
        if not self.decode:
            raise ValueError("prefill needs --decode addresses for its KV")


def _check_prefill(c) -> None:
    _check_peers(c)
    _addrs(c.decode, "decode")
    if c.max_batched_tokens < 1 or c.max_prefill_batch < 1 or c.max_inflight < 1:
        raise ValueError("--max-batched-tokens, --max-prefill-batch and --max-inflight must be >= 1")


@dataclass(frozen=True)
class EncodeConfig(PrefillFields, StageConfig):
    prefill: tuple[str, ...] = opt((), "remote prefill instances, host:port,...", wired=True)
    colocate_prefill: bool = opt(False, "run a prefill in this process, on this device")
    remote_fraction: float = opt(1.0, "s: share of requests sent to remote prefill")
    max_batch: int = opt(8, "B: most requests per encode batch")
    batch_mode: str = opt("adaptive", "encode batching: adaptive (size, arrival gap, cap), fixed (size, cap), "
                          "request_at_a_time (one at a time), continuous (a free encoder takes all pending at "
                          "once); in every mode arrivals wait while the encoder is busy", choices=BATCH_MODES)
    safety_cap_s: float = opt(1.0, "longest a request waits for a batch")
    gap_coef: float = opt(2.0, "gap threshold = gap_coef / lambda")
    max_gap_s: float = opt(0.05, "ceiling of the gap threshold")
    sm_backend: str = opt("auto", "how co-located prefill shares the device: auto = the best mechanism here "
                          "(time-slicing, reported as degraded, when there is none); a named one fails the start "
                          "when unavailable; static = a fixed 50/50 split", choices=SM_BACKENDS)
    partition_policy: str = opt("dynamic", "SM partition policy: dynamic (per batch, from the profile), static "
                                "(exactly 50/50), timeslice (no partition)", choices=PARTITION_POLICIES)
    partition_profile: str = opt("", "partition profile file: loaded if present, else written")
    profile_batch_sizes: str = opt("1,2,4,8", "batch sizes the partition profile measures")
    partition_tolerance: float = opt(0.1, "share kept: encode within this of its exclusive latency")
    encoder_cache_gb: float = opt(1.0, "encoder-output cache: GB of embeddings held (LRU by bytes, on the "
                                  "encode device) for media seen again; 0 turns it off")

    def __post_init__(self) -> None:
        StageConfig.__post_init__(self)
        _check_prefill(self)
        _addrs(self.prefill, "prefill")
        if not 0.0 <= self.remote_fraction <= 1.0:
            raise ValueError(f"--remote-fraction (s) must be in [0, 1], got {self.remote_fraction}")
        if self.max_batch < 1:
            raise ValueError(f"--max-batch (B) must be >= 1, got {self.max_batch}")
        if self.batch_mode == "request_at_a_time" and self.max_batch != 1:
            raise ValueError(f"--batch-mode request_at_a_time takes --max-batch 1, got {self.max_batch}")
        if not self.colocate_prefill and not self.prefill:
            raise ValueError("encode needs --colocate-prefill or --prefill addresses")
        if self.colocate_prefill and not self.decode and type(self) is EncodeConfig:
            raise ValueError("--colocate-prefill needs --decode addresses for its KV")
        if self.remote_fraction < 1.0 and not self.colocate_prefill:
            raise ValueError(f"--remote-fraction {self.remote_fraction} < 1 sends requests to a local "
                             "prefill; add --colocate-prefill or set it to 1.0")
        if self.safety_cap_s <= 0 or self.max_gap_s <= 0 or self.gap_coef <= 0:
            raise ValueError("--safety-cap-s, --max-gap-s and --gap-coef must be > 0")
        contra = {("static", "timeslice"), ("timeslice", "static")}
        if (self.partition_policy, self.sm_backend) in contra:
            raise ValueError(f"--partition-policy {self.partition_policy} contradicts --sm-backend {self.sm_backend}: "
                             "drop one (--sm-backend static is the 50/50 split, timeslice none)")
        if not self.encoder_cache_gb >= 0:
            raise ValueError(f"--encoder-cache-gb must be >= 0 (0 turns the cache off), got {self.encoder_cache_gb}")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(x) for x in self.profile_batch_sizes.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--profile-batch-sizes must be comma-separated ints, got "
                             f"{self.profile_batch_sizes!r}") from None
        return sizes


@dataclass(frozen=True)
class MonolithConfig(EngineFields, EncodeConfig):
    """Encode, prefill and decode in one process (the aggregated, vLLM-like baseline): it
    serves the Encode, Prefill and Decode services on one port; KV stays in-process."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "colocate_prefill", True)
        object.__setattr__(self, "remote_fraction", 0.0)
        EncodeConfig.__post_init__(self)
        _check_engine(self)


@dataclass(frozen=True)
class GatewayConfig(PeerFields, StageConfig):
    listen: str = opt("127.0.0.1:50051", "gRPC address to bind (the public SDK API)", wired=True)
    http_listen: str = opt("127.0.0.1:8000", "OpenAI-compatible HTTP address", wired=True)
    http_port_file: str = opt("", "write the bound HTTP port here", wired=True)
    encode: tuple[str, ...] = opt((), "encode instances, host:port,...", wired=True)
    prefill: tuple[str, ...] = opt((), "prefill instances for text-only requests, host:port,...", wired=True)
    decode: tuple[str, ...] = opt((), "decode instances (reservations; tokens stream from them)", wired=True)
    served_model_name: str = opt("", "model id clients send (default: the folder's name)")
    request_timeout_s: float = opt(600.0, "default deadline of a request, seconds")
    default_max_tokens: int = opt(256, "max_tokens when a request sets none")
    max_body_mb: float = opt(64.0, "largest HTTP request body")
    max_model_len: int = opt(0, "prompt + max_tokens limit (0: the model's, capped at 4096 like decode)")
    max_inflight: int = opt(1024, "past this many requests: 429 / RESOURCE_EXHAUSTED")
    preprocess_threads: int = opt(2, "threads for chat templates, tokenization and media")
    allowed_media_domains: tuple[str, ...] = opt((), "hosts media URLs may name (*.example.com for subdomains); "
                                                 "empty: any public host. Private / loopback addresses are "
                                                 "refused unless their host is listed here")
    allowed_local_media_path: str = opt("", "serve file:// media URLs from below this folder (empty: refused)")
    media_max_mb: float = opt(64.0, "largest media file fetched by URL, MB")
    media_timeout_s: float = opt(10.0, "time limit of one media URL fetch")
    media_max_mpixels: float = opt(256.0, "decoded pixels per request (all images and video frames), millions")
    media_hash_entries: int = opt(65536, "media content hashes remembered (hash -> the encode instance sent it, "
                                  "and the item's prompt metadata) for encoder-cache-aware placement and "
                                  "pixel-free requests that skip preprocessing; 0: no hashing")
    encoder_cache_affinity: int = opt(4, "send a request to the encode instance holding its media unless that "
                                      "instance has this many more calls open than the least loaded one")
    api_key: tuple[str, ...] = opt((), "API keys clients must send (HTTP Authorization: Bearer KEY, gRPC "
                                   "metadata authorization); repeatable or comma-separated, default "
                                   "$EASERVE_API_KEY; empty (and no --api-key-file): no keys asked. Not for "
                                   "deployment files (keys on a command line show in ps): use --api-key-file",
                                   repeat=True, secret=True, wired=True)
    api_key_file: str = opt("", "file of API keys, one a line (# comments); adds to --api-key")

    def __post_init__(self) -> None:
        StageConfig.__post_init__(self)
        _check_peers(self)
        for flag in ("encode", "prefill", "decode"):
            _addrs(getattr(self, flag), flag)
        if not self.prefill or not self.decode:
            raise ValueError("the gateway needs --prefill and --decode addresses")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
        if self.default_max_tokens < 1 or self.max_inflight < 1 or self.preprocess_threads < 1:
            raise ValueError("--default-max-tokens, --max-inflight and --preprocess-threads must be >= 1")
        if self.media_hash_entries < 0 or self.encoder_cache_affinity < 0:
            raise ValueError("--media-hash-entries and --encoder-cache-affinity must be >= 0")

    @property
    def served_model(self) -> str:
        """The model id clients send: --served-model-name, else the checkpoint folder's name."""
        from pathlib import Path
        return self.served_model_name or Path(self.model).resolve().name


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "decode": DecodeConfig, "prefill": PrefillConfig, "encode": EncodeConfig,
    "monolith": MonolithConfig, "gateway": GatewayConfig,
}


# ---- command lines ---------------------------------------------------------------------------
def _flag(name: str) -> str:
    return name.replace("_", "-")


def _kind(cls, f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    return tuple if hint is tuple or typing.get_origin(hint) is tuple else hint


def parser(cls: type[StageConfig], stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.{stage}", description=f"EAServe {stage} stage")
    for f in dataclasses.fields(cls):
        kind, flag = _kind(cls, f), f"--{_flag(f.name)}"
        default = _default(f)
        helptext = f.metadata.get("help", "")
        if f.metadata.get("repeat"):
            p.add_argument(flag, type=_split, action="append", default=None, help=helptext)
        elif kind is bool:
            p.add_argument(flag, action="store_true", default=default, help=helptext)
        elif kind is tuple:
            p.add_argument(flag, type=_split, default=default, help=helptext)
        else:
            p.add_argument(flag, type=kind, default=default, help=helptext,
                           choices=f.metadata.get("choices"))
    return p


def _default(f: dataclasses.Field) -> Any:
    """A flag's default: the field's, or for --log-level / --api-key the environment's."""
    if f.name == "log_level":
        return os.environ.get("EASERVE_LOG_LEVEL", f.default)
    if f.name == "api_key":
        return _split(os.environ.get("EASERVE_API_KEY", ""))
    return f.default


def _split(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def from_argv(cls: type[StageConfig], stage: str, argv: list[str]):
    """Parse a stage's command line into its config; a bad value exits with the message."""
    p = parser(cls, stage)
    kw = vars(p.parse_args(argv))
    for f in dataclasses.fields(cls):
        if f.metadata.get("repeat"):  # None: not given (the parser's default); else a list of tuples
            given = kw[f.name]
            kw[f.name] = _default(f) if given is None else tuple(a for part in given for a in part)
    try:
        return cls(**kw)
    except ValueError as e:
        p.error(str(e))


def tunable_flags(stage: str) -> tuple[str, ...]:
    """Flags (dashed) a deployment file may set for `stage`."""
    return tuple(_flag(f.name) for f in dataclasses.fields(STAGE_CONFIGS[stage]) if not f.metadata.get("wired"))


def flag_kind(stage: str, flag: str) -> type:
    cls = STAGE_CONFIGS[stage]
    f = {_flag(x.name): x for x in dataclasses.fields(cls)}[flag]
    return _kind(cls, f)


def to_argv(cfg: StageConfig) -> list[str]:
    """The command line that parses back into `cfg`: the wired fields (model, device,
    addresses) always, the others where they differ from their default."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v in ("", ()) or (v == f.default and not f.metadata.get("wired")):
            continue
        if isinstance(v, bool):
            out += [f"--{_flag(f.name)}"] if v else []
        elif f.metadata.get("repeat"):
            out += [x for a in v for x in (f"--{_flag(f.name)}", a)]
        elif isinstance(v, tuple):
            out += [f"--{_flag(f.name)}", ",".join(v)]
        else:
            out += [f"--{_flag(f.name)}", str(v)]
    return out
