"""Discrete-event simulator of an E/P/D deployment over the live policy classes.

The batcher, router, partitioner, prefill planner, placement (on polled load reports), the
gateway's admission, the encoder and prefix caches' bookkeeping and the decode engine's
`Scheduler` are the services' own classes, built from the same frozen stage configs; only
the compute is replaced by service times read from an `easerve.profile/v1` file. Pure Python:
no torch, no I/O (the caller loads the profile). Entry point: `run.simulate`.
"""
from easerve.sim.run import SimResult, simulate
from easerve.sim.topology import Topology
from easerve.sim.workload import SimRequest

__all__ = ["SimRequest", "SimResult", "Topology", "simulate"]
