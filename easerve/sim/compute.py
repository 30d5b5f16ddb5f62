"""A worker's compute in the simulator: the jobs it runs (encode batches, prefill batches, decode
steps), how the busy workers that share its device or cores slow it, and the workers of one
process that run one job at a time.

- Sharing is re-evaluated at every moment a neighbour starts or ends a job (processor sharing):
  a job holds its remaining work in unshared seconds, and each change of the busy set ends the
  stretch at the old factor and reschedules the job's end at the new one. `factor()` is the
  slowdown at this moment (see easerve/policy/service_model.py for its parts).
- `process`: the workers of one process (an encode instance and its co-located prefill; a
  monolith's encode, prefill and decode) slow each other by the profile's measured pairs;
  workers of other processes on the same CPU cores by the profile's sharing curve.
- the environment: a model worker on CPU cores that a worker of another process also computes
  on is launched with SHARED_CORES_ENV (hasctl/deployment.py `shares_cores`), which slows
  each of its jobs by the profile's `shared_env` factor even with no neighbour busy
  (`shared_cores_env`; the sharing curve is relative to that environment's own time).
- `serial`: a `SerialGroup` the workers of one monolith share with ModelConfig(monolith="serial"):
  its encode batches, prefill batches and decode steps run one at a time, as in a process whose
  one interpreter and thread pool admit one stage at a time: a worker that has work while
  another of the group runs waits for it (in the order they asked), and the group's jobs do not
  slow each other. (The default, "threads", runs them concurrently, as the monolith service's
  threads do, slowed by the profile's in-process pairs.)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from easerve.policy.service_model import ServiceModel
from easerve.sim.events import EventQueue


class SerialGroup:
    """Workers that run one job at a time, taking turns in the order they asked."""

    def __init__(self) -> None:
        self.holder: Compute | None = None
        self.waiters: deque[tuple[Compute, Callable[[], None]]] = deque()


class Compute:
    """One worker's compute on a device (with `tp` > 1: the GPUs cuda:N .. cuda:N+tp-1)."""

    def __init__(self, events: EventQueue, model: ServiceModel, kind: str, device: str, tp: int = 1,
                 process: str = "", serial: SerialGroup | None = None) -> None:
        self.events, self.model = events, model
        self.kind, self.device, self.tp = kind, device, tp
        self.process, self.serial = process or f"{kind}@{id(self)}", serial
        self.busy_kind: str | None = None
        self.neighbours: list[Compute] = []
        self.busy_s = 0.0
        self.env = 1.0            # the environment's factor (wire_env)
        self._left = 0.0          # the running job's work left, in unshared seconds, at self._since
        self._since = 0.0
        self._factor = 1.0
        self._end = 0.0
        self._factor_fn: Callable[[], float] = self.factor
        self._done: Callable[[], None] | None = None
        self._version = 0

    @property
    def cpu(self) -> bool:
        return not self.device.startswith("cuda")

    def factor(self, skip: Compute | None = None) -> float:
        """This worker's slowdown now: 1 + the sum of (measured pair - 1) over its busy
        neighbours of the same process (and, on a GPU, of any process), times the sharing
        slowdown of the busy neighbours of other processes on the same CPU cores, times its
        environment's factor (`env`), times the cores taken by busy host threads
        (easerve/sim/host.py). A host job's own: the runnable threads on its cores (one per busy
        host job, one per core for each busy model job) over the cores, at least 1."""
        model, f, others, hosts, jobs = self.model, 1.0, [], 0, 0
        if self.kind == "host" and not model.cores_shared:
            return 1.0
        for n in self.neighbours:
            if n.busy_kind is None or n is skip:
                continue
            if n.kind == "host" or self.kind == "host":
                hosts += n.kind == "host"
                jobs += n.kind != "host"
                continue
            if self.cpu and n.process != self.process:
                others.append(n.busy_kind)
            else:
                f += model.slowdown(self.kind, n.busy_kind, self.cpu) - 1.0
        if self.kind == "host":
            cores = model.cores(self.device)
            return max(1.0, (1 + hosts + jobs * cores) / cores)
        f = (f * model.sharing(self.kind, tuple(sorted(others))) if others else f) * self.env
        return f * (1.0 + hosts / model.cores(self.device)) if hosts and self.cpu and model.cores_shared else f

    def shared_cores_env(self) -> bool:
        """Whether the live launcher starts this worker with SHARED_CORES_ENV: a model worker on
        CPU cores that a model worker of another process also computes on."""
        return self.cpu and self.kind != "host" and any(
            n.kind != "host" and n.process != self.process for n in self.neighbours)

    def wire_env(self) -> None:
        """Set `env` from the neighbours (call once they are wired)."""
        self.env = self.model.shared_env(self.kind) if self.shared_cores_env() else 1.0

    # ---- one process, one job at a time ------------------------------------------------------------
    def acquire(self, kick: Callable[[], None]) -> bool:
        """May this worker start a job now? False: another worker of its serial group runs one;
        `kick` is called once the turn comes to this worker."""
        g = self.serial
        if g is None or g.holder is self:
            return True
        if g.holder is None:
            g.holder = self
            return True
        if all(c is not self for c, _ in g.waiters):
            g.waiters.append((self, kick))
        return False

    def release(self) -> None:
        """This worker's turn ends (its job ended, or it had nothing to run): the next in line's begins."""
        g = self.serial
        if g is None or g.holder is not self:
            return
        g.holder = None
        if g.waiters:
            nxt, kick = g.waiters.popleft()
            g.holder = nxt
            self.events.after(0.0, nxt._take_turn, kick)

    def _take_turn(self, kick: Callable[[], None]) -> None:
        kick()
        if self.serial.holder is self and self.busy_kind is None:
            self.release()  # it had nothing to run by now

    # ---- jobs under processor sharing ----------------------------------------------------------------
    def start(self, kind: str, work_s: float, done: Callable[[], None],
              factor: Callable[[], float] | None = None) -> float:
        """Run a job of `work_s` unshared seconds; `done()` at its end. `factor`: this job's
        slowdown at a moment (default `self.factor`). Returns the end it is due at now."""
        if self.busy_kind is not None:
            raise RuntimeError(f"{self.kind} on {self.device} started a job while running one")
        now = self.events.now()
        self.busy_kind, self._done = kind, done
        self._factor_fn = factor or self.factor
        self._left, self._since = work_s, now
        self._factor = self._factor_fn()
        self._end = now + work_s * self._factor
        self.busy_s += self._end - now
        self._schedule()
        self._neighbours_changed()
        return self._end

    def _schedule(self) -> None:
        self._version += 1
        self.events.at(self._end, self._finish, self._version)

    def _finish(self, version: int) -> None:
        if version != self._version or self.busy_kind is None:
            return  # rescheduled since
        done, self._done = self._done, None
        self.busy_kind = None
        self._neighbours_changed()
        done()

    def _rescale(self) -> None:
        """A neighbour started or ended a job: the stretch so far ran at the old factor."""
        if self.busy_kind is None:
            return
        now = self.events.now()
        self._left = max(0.0, self._left - (now - self._since) / self._factor)
        self._since = now
        f = self._factor_fn()
        if f == self._factor:
            return
        self._factor = f
        end = now + self._left * f
        self.busy_s += end - self._end
        self._end = end
        self._schedule()

    def _neighbours_changed(self) -> None:
        for n in self.neighbours:
            n._rescale()
