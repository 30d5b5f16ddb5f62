"""Flags every stage process shares, and the process bootstrap."""
from __future__ import annotations

import argparse
import logging
import os


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096  # default per-request token limit (prompt + max_tokens) of a deployment


def default_max_len(text_config) -> int:
    """The model's context length, capped at DEFAULT_MAX_MODEL_LEN (gateway and decode agree)."""
    return min(int(getattr(text_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)), DEFAULT_MAX_MODEL_LEN)


def base_parser(stage: str, default_listen: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.{stage}", description=f"EAServe {stage} stage")
    p.add_argument("--model", required=True, help="checkpoint folder (a supported family)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--listen", default=default_listen, help="gRPC address to bind, host:port (port 0 = any)")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--log-level", default=os.environ.get("EASERVE_LOG_LEVEL", "INFO"))
    return p


def dtype_of(name: str):
    """A --dtype value -> torch dtype, or None for auto (the adapter's default for its device)."""
    from easerve.models.registry import torch_dtype
    return torch_dtype(name)


def addrs(value: str) -> tuple[str, ...]:
    """Comma-separated host:port list."""
    out = tuple(a.strip() for a in (value or "").split(",") if a.strip())
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {a!r} must be host:port")
    return out


def setup_process(args) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)


def write_port_file(path: str | None, port: int) -> None:
    """Let a launcher learn the port bound for `--listen host:0`."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)
