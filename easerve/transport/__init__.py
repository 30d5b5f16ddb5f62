"""KV transports between prefill and decode (`--kv-transport`): `KINDS` are the choices, "auto"
picks per decode instance from where the two processes live (handoff.choose_kind). The same
transports carry embeddings from encode to remote prefill (`--embed-transport`:
"inline" puts the bytes in the message, the fallback "auto" takes where nothing else reaches)."""
from typing import Literal, get_args

KVTransportKind = Literal["auto", "inline", "shm", "grpc", "cuda_ipc", "nccl"]
KINDS: tuple[str, ...] = get_args(KVTransportKind)
EmbedTransportKind = Literal["auto", "inline", "shm", "cuda_ipc", "nccl"]
