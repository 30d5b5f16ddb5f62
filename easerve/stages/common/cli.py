"""The process bootstrap every stage shares: logging, CPU cores and threads, port files.
(The flags themselves are generated from each stage's config: `easerve.stages.common.configs`.)"""
from __future__ import annotations

import logging
import os
import sys

from easerve.rpc.server import run
from easerve.fields import cpu_cores
from easerve.stages.common.argv import from_argv


def setup_process(cfg) -> None:
    """Logging; on a `cpu:0-3` device, pin the process to those cores and use one torch
    thread per core (unless --threads says otherwise)."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cores = cpu_cores(cfg.device)
    if cores is not None:
        allowed = os.sched_getaffinity(0)
        missing = sorted(set(cores) - allowed)
        if missing:
            raise ValueError(f"--device {cfg.device}: cores {missing} are not available to this process "
                             f"(it may use {sorted(allowed)})")
        os.sched_setaffinity(0, cores)
    threads = cfg.threads or (len(cores) if cores is not None else 0)
    if threads > 0:
        import torch
        torch.set_num_threads(threads)


def write_port_file(path: str | None, port: int) -> None:
    """Let a launcher learn the port bound for `--listen host:0`."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)


def dtype_of(name: str):
    """--dtype -> a torch dtype, or None for auto (the adapter's default for its device)."""
    from easerve.models.registry import torch_dtype
    return torch_dtype(name)


def run_stage(cfg_cls, stage: str, main) -> None:
    """A stage process's whole entry point: its config from argv, the process set up, `main(cfg)` served."""
    cfg = from_argv(cfg_cls, stage, sys.argv[1:])
    setup_process(cfg)
    run(main(cfg))
