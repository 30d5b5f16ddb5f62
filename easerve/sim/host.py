"""A stage process's host thread in the simulator: the per-request CPU work a live process does
outside model compute (ModelConfig.host_s: parsing, media, tokenization, serialization, gRPC,
streaming), run as jobs of one thread on the process's cores, one at a time in arrival order.

On CPU cores a busy host job and the model's jobs share the cores (easerve/sim/compute.py
`Compute.factor`): a model job runs a thread per core of its device, a host job one thread, and
when more threads are runnable than there are cores each gets cores / threads of a core. So host
work takes core time from the model and the model from it; on a GPU node host jobs share the
host's cores only with each other.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from easerve.policy.service_model import ServiceModel
from easerve.sim.compute import Compute
from easerve.sim.events import EventQueue

HOST_DEVICE_ON_GPU = "cpu"  # where a GPU stage's host thread runs: the node's cores


class HostWorker:
    """One process's host thread: `run(seconds, done)` queues a job; `done()` at its end."""

    def __init__(self, events: EventQueue, model: ServiceModel, device: str, process: str) -> None:
        device = HOST_DEVICE_ON_GPU if device.startswith("cuda") else device
        self.compute = Compute(events, model, "host", device, 1, process)
        self.queue: deque[tuple[float, Callable[[], None]]] = deque()
        self.jobs = 0

    def run(self, seconds: float, done: Callable[[], None]) -> None:
        if seconds <= 0.0:
            done()
            return
        self.queue.append((seconds, done))
        self._next()

    def _next(self) -> None:
        if self.compute.busy_kind is not None or not self.queue:
            return
        seconds, done = self.queue.popleft()
        self.jobs += 1

        def end() -> None:
            done()
            self._next()
        self.compute.start("host", seconds, end)
