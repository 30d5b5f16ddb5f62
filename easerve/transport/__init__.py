"""KV transports between prefill and decode (`--kv-transport`): `KINDS` are the choices, "auto"
picks per decode instance from where the two processes live (handoff.choose_kind)."""
from typing import Literal, get_args

KVTransportKind = Literal["auto", "inline", "shm", "grpc", "cuda_ipc"]
KINDS: tuple[str, ...] = get_args(KVTransportKind)
