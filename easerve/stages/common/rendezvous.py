"""Where a receiving stage's NCCL pair store listens (decode for KV, prefill for embeddings;
`cfg` has easerve.stages.common.configs.RendezvousFields and StageConfig's listen / device)."""
from __future__ import annotations

import ipaddress
import socket


def rendezvous_listen(cfg) -> str:
    """Where this instance's NCCL pair store listens: --kv-rendezvous host:port; by default, on a
    CUDA instance that listens beyond loopback, its --listen host (any port), a wildcard host
    advertised as this host's name; "" (none) otherwise and for "off". torch's TCPStore listens on
    every interface, so a stage kept on loopback never opens one unless asked."""
    if cfg.kv_rendezvous == "off":
        return ""
    if cfg.kv_rendezvous:
        return cfg.kv_rendezvous
    host = cfg.listen.rsplit(":", 1)[0].strip("[]")
    if not cfg.torch_device.startswith("cuda") or _loopback(host):
        return ""
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:0"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
