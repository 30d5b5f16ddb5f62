"""Tensor-parallel instances in a deployment file: a worker's `tp` key.

    decode: [{device: cuda:2, tp: 2}]     # one decode instance spanning cuda:2 and cuda:3

A worker with `tp: k` is one instance over the k GPUs cuda:N .. cuda:N+k-1 (N its device's
index). Rules, each checked with an error that names what to change:
- tp is an int >= 1 (1, the default, is one device);
- tp > 1 needs a `cuda:N` device (a CPU worker's devices are its cores: `cpu:0-3`), and N a
  multiple of tp, so groups are aligned (NVLink pairs / quads) and two groups of the same tp
  either coincide (workers sharing those GPUs, as on one device) or are disjoint;
- two groups may not overlap partly: a GPU belongs to one group of each size at most, and a
  smaller group inside a larger one shares its GPUs (like workers sharing a device).

Honoured by `hasctl simulate` and `hasctl tune --evaluator sim` (easerve.sim: the instance holds
its k GPUs, its service times come from the profile taken with `--tp k`) and by `hasctl screen`
(a tp-k profile's instance takes k devices). The stage processes run one device each, so
`hasctl up` / compose / k8s refuse a tp > 1 worker (`check_launchable`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from easerve.policy.service_model import gpu_group


def gpu_index(device: str) -> int | None:
    """N of `cuda:N` (plain `cuda` is 0); None for a CPU device."""
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def check_tp(tp: Any, device: str, where: str) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{where}.tp must be an int >= 1 (the GPUs one instance spans), got {tp!r}")
    if tp == 1:
        return
    first = gpu_index(device)
    if first is None or device == "cuda":
        raise ValueError(f"{where}: tp {tp} needs a device cuda:N (the group's first GPU), got {device!r}; "
                         f"set device to cuda:N or tp to 1")
    if first % tp:
        lo = first - first % tp
        raise ValueError(f"{where}: a tp {tp} group must start at a GPU index that is a multiple of {tp}, "
                         f"got {device}; use cuda:{lo} or cuda:{lo + tp}")


def check_groups(workers: Iterable[tuple[str, str, int]]) -> None:
    """`workers`: (where, device, tp). Groups coincide, nest or are disjoint; never overlap partly."""
    seen: list[tuple[str, frozenset[int]]] = []
    for where, device, tp in workers:
        mine = frozenset(gpu_group(device, tp))
        for other, theirs in seen:
            if mine & theirs and not (mine <= theirs or theirs <= mine):
                raise ValueError(f"{where} (GPUs {sorted(mine)}) overlaps {other} (GPUs {sorted(theirs)}) in part; "
                                 f"give both the same device and tp, or disjoint GPUs")
        if mine:
            seen.append((where, mine))


def check_launchable(d: Any) -> None:
    """Refuse a deployment `d` with a tp > 1 worker: the stage processes run one device each."""
    wide = [f"{s}[{i}] (tp {w.tp})" for s in ("decode", "prefill", "encode", "monolith")
            for i, w in enumerate(getattr(d, s)) if w.tp > 1]
    if wide:
        raise ValueError(f"{', '.join(wide)}: the stage processes run on one device each, so tp > 1 is honoured by "
                         f"hasctl simulate / tune --evaluator sim / screen only; set tp to 1 to launch")
