"""Small topologies and workloads for the simulator tests."""
from __future__ import annotations

import random

from easerve.sim import SimRequest, Topology
from easerve.stages.common.configs import (
    DecodeConfig,
    EncodeConfig,
    GatewayConfig,
    MonolithConfig,
    PrefillConfig,
)

A = ("127.0.0.1:1",)


def topo(n_enc=1, n_pre=1, n_dec=1, n_mono=0, enc=None, dec=None, gw=None, pre=None, device="cuda:{i}") -> Topology:
    enc, dec, gw, pre = enc or {}, dec or {}, gw or {}, pre or {}
    dev = iter(range(100))
    return Topology(
        GatewayConfig(model="m", prefill=A, decode=A, **gw),
        tuple(EncodeConfig(model="m", device=device.format(i=next(dev)), prefill=A if n_pre else (), decode=A,
                           **enc) for _ in range(n_enc)),
        tuple(PrefillConfig(model="m", device=device.format(i=next(dev)), decode=A, **pre) for _ in range(n_pre)),
        tuple(DecodeConfig(model="m", device=device.format(i=next(dev)), **dec) for _ in range(n_dec)),
        tuple(MonolithConfig(model="m", device=device.format(i=next(dev))) for _ in range(n_mono)))


def poisson(n: int, rate: float, seed: int = 0, modality: str = "image", max_tokens: int = 8) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        out.append(SimRequest(i, t, modality, "224x224" if modality == "image" else "", 16, max_tokens))
        t += rng.expovariate(rate)
    return out
