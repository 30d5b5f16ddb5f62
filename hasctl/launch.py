"""Run a deployment's processes on this host and keep them alive: `Stack`.

    with Stack(preset("default").with_model(path).with_gateway_ports(0, 0)) as stack:
        Client(stack.endpoints.grpc).generate("hi")

Each stage is a `python -m services.<stage>` child in its own process group, its stdout and
stderr appended to <run_dir>/<name>.log. `start()` waits until every process reports
grpc.health.v1 SERVING and fails fast, with the log's tail, when one exits first. Afterwards a
supervisor thread restarts a process that dies (same argv and port; exponential backoff over
the runs that died before answering SERVING, a crash loop; a run that served restarts at once),
first unlinking the shared-memory slabs dead processes left (`shm_reclaim`), and counts it
in `restarts`. With `standby=True` each stage process has a standby next to it that has
done its imports already (`hasctl.standby`); a restart promotes it, skipping most of a cold
start. `stop()`: SIGTERM to each group, a grace period, then SIGKILL.
`tls=Tls(cert, key, ca)` runs every process with those --tls-* flags (TLS between all of
them and on the gateway) and health-checks them over TLS.

Instances come and go while the stack runs: each process that calls others reads its peers
from <run_dir>/<name>.peers.json (`--peers-file`), which the launcher replaces atomically.
`add_instance(stage)` starts one more instance and lists it once it is SERVING;
`remove_instance(name)` unlists it, gives the callers a moment to read the list again, then
drains it (SIGTERM: NOT_SERVING, its open calls finish, it exits).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from easerve.healthcheck import check
from easerve.rpc.tls import NO_TLS, Tls
from easerve.stages.common.peer_sources import write_peers_file
from easerve.transport.shm_reclaim import reclaim_stale
from hasctl.forked import ForkedProcess, ForkServer, forkable
from hasctl.deployment import (STAGES, Command, Deployment, Worker, command_stop_s, peer_roles, peer_lists,
                               process_names, stage_command, to_commands)

log = logging.getLogger("hasctl.launch")
_REPO = Path(__file__).resolve().parents[1]
_SPARE_AFTER_S = 10.0  # a standby is started this long after the process it stands by for
_SERVED_POLL_S = 0.5  # the supervisor asks a run that has not answered SERVING yet this often
GROUP_REAP_S = 5.0     # how long stop() waits for init to reap what a killed process group leaves


class StageExited(RuntimeError):
    """A stage process exited while the stack was starting; the message holds its log's tail."""


@dataclass(frozen=True)
class Endpoints:
    grpc: str                     # host:port of the gateway's gRPC API (easerve.Client)
    http: str                     # http://host:port, the OpenAI-compatible API
    stages: dict[str, str] = field(default_factory=dict)  # process name -> host:port
    metrics: dict[str, str] = field(default_factory=dict)  # process name -> http://host:port of /metrics

    @property
    def openai_base_url(self) -> str:
        return f"{self.http}/v1"


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PICKED_PORTS_FROM = 10000
_PICKED: dict[int, None] = {}  # this process's recent picks, oldest first: not handed out twice while unbound


def ephemeral_ports(path: str = EPHEMERAL_RANGE_FILE) -> range:
    """The kernel's ephemeral port range, where outgoing connections take their local ports
    (Linux's default when it cannot be read)."""
    try:
        lo, hi = map(int, Path(path).read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing on `host` holds now, for a process started next to bind. It is drawn
    outside the ephemeral range: a port the kernel hands out for binding port 0 is one an outgoing
    connection can take before the process binds it (a decode stage's --metrics-listen failed so,
    EADDRINUSE, in a loaded test)."""
    eph = ephemeral_ports()
    below, above = range(PICKED_PORTS_FROM, max(PICKED_PORTS_FROM, eph.start)), range(eph.stop, 65536)
    pool = below if len(below) >= len(above) else above
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.choice(pool)
        if port not in _PICKED and _bindable(host, port):
            _PICKED[port] = None
            while len(_PICKED) > len(pool) // 4:
                del _PICKED[next(iter(_PICKED))]
            return port
    raise OSError(f"no free port on {host or '0.0.0.0'} in {pool.start}-{pool.stop - 1} after 100 tries")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("", "0.0.0.0") else "", port))
        except OSError:
            return False
    return True


def assign_ports(d: Deployment, host: str = "127.0.0.1", base_port: int | None = None) -> dict[str, int]:
    """Ports for every process: fixed ones from the deployment, zeros from base_port upwards or free ones."""
    fixed = {f"{s}-{i}": w.port for s in STAGES for i, w in enumerate(getattr(d, s))}
    fixed.update({"gateway": d.gateway.grpc_port, "gateway-http": d.gateway.http_port})
    taken, out, nxt = set(fixed.values()), {}, base_port
    for name in process_names(d):
        port = fixed[name]
        while not port:
            if nxt is None:
                port = free_port(host)
            else:
                port, nxt = nxt, nxt + 1
            port = 0 if port in taken else port
        taken.add(port)
        out[name] = port
    return out


def health_ok(addr: str, service: str = "", timeout: float = 1.0, tls: Tls = NO_TLS) -> bool:
    """True iff `addr` answers grpc.health.v1 Check(service) with SERVING."""
    return check(addr, service, timeout, tls) == "SERVING"


def with_tls(d: Deployment, tls: Tls) -> Deployment:
    """`d` with the --tls-* flags of `tls` on every process."""
    flags = {k: v for k, v in (("tls_cert", tls.cert), ("tls_key", tls.key), ("tls_ca", tls.ca),
                               ("tls_client_auth", tls.client_auth)) if v}
    for stage in (*STAGES, "gateway"):
        d = d.with_flags(stage, **flags)
    return d


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _keep_profile(cmd: Command, run_dir: Path) -> Command:
    """An encode worker with co-located prefill saves its start-up encode profile in the run
    dir (unless the deployment names a file), so a restarted worker reuses it."""
    if cmd.stage != "encode" or "--colocate-prefill" not in cmd.argv or "--partition-profile" in cmd.argv:
        return cmd
    path = run_dir / f"{cmd.name}.encode-profile.json"
    return dataclasses.replace(cmd, argv=(*cmd.argv, "--partition-profile", str(path)))


def _serve_metrics(cmd: Command, host: str) -> Command:
    """A stage process with `--metrics-listen` on a free port of `host`, unless it has one."""
    if cmd.stage == "gateway" or "--metrics-listen" in cmd.argv:
        return cmd
    return dataclasses.replace(cmd, argv=(*cmd.argv, "--metrics-listen", f"{host}:{free_port(host)}"))


@dataclass
class _Proc:
    cmd: Command
    log: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    failures: int = 0             # consecutive runs that died before SERVING (and within 60 s), for the backoff
    served: bool = False          # this run has answered SERVING (seen by the supervisor)
    checked_at: float = 0.0       # the supervisor's last health check of this run
    restart_at: float | None = None
    listed: bool = True           # in its callers' peers files
    peers_file: Path | None = None
    spare: subprocess.Popen | None = None  # a pre-imported standby (hasctl.standby), when enabled
    spare_broken: bool = False    # a standby exited on its own: cold restarts only for this process


class Stack:
    def __init__(self, deployment: Deployment, *, host: str = "127.0.0.1", base_port: int | None = None,
                 run_dir: str | Path | None = None, python: str | None = None, restart: bool = True,
                 backoff_s: tuple[float, float] = (0.5, 15.0), env: dict[str, str] | None = None,
                 tls: Tls = NO_TLS, standby: bool = False, metrics: bool = False, fork: bool = False):
        """`metrics`: every stage process serves /metrics (encode also /trace) on a free port
        (`endpoints.metrics`) unless its flags name --metrics-listen (`hasctl up` turns it on).
        `fork`: stage processes and their restarts are forked from a process that did their
        imports once (`hasctl.forked`), instead of standbys (`standby`) or cold starts."""
        if not deployment.model:
            raise ValueError("the deployment has no model; call deployment.with_model(path) first")
        self.tls = tls
        if tls.serving:
            deployment = with_tls(deployment, tls)
        self.deployment, self.host, self.restart = deployment, host, restart
        self.backoff_s, self._env, self.standby, self.metrics = backoff_s, dict(env or {}), standby, metrics
        if fork and standby:
            raise ValueError("fork and standby are two ways to skip a restart's imports; choose one")
        self.fork, self._forks = fork, None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="easerve-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ports = assign_ports(deployment, host, base_port)
        cmds = [self._extras(c) for c in to_commands(deployment, host, self.ports, python or sys.executable)]
        self._procs = {c.name: _Proc(c, self.run_dir / f"{c.name}.log") for c in cmds}
        self._python = python or sys.executable
        self._next_index = {s: len(getattr(deployment, s)) for s in STAGES}
        for p in self._procs.values():
            self._give_peers_file(p)
        self._write_peers_files()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervising = False
        self._thread: threading.Thread | None = None

    def _extras(self, cmd: Command) -> Command:
        cmd = _keep_profile(cmd, self.run_dir)
        return _serve_metrics(cmd, self.host or "0.0.0.0") if self.metrics else cmd

    # ---- views ------------------------------------------------------------------------------------
    @property
    def endpoints(self) -> Endpoints:
        peer = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        metrics = {n: "http://" + peer + ":" + flag.rpartition(":")[2] for n, p in self._procs.items()
                   if (flag := _flag(p.cmd.argv, "--metrics-listen"))}
        return Endpoints(grpc=f"{peer}:{self.ports['gateway']}", http=f"http://{peer}:{self.ports['gateway-http']}",
                         stages={n: f"{peer}:{p.cmd.port}" for n, p in self._procs.items()},
                         metrics={"gateway": f"http://{peer}:{self.ports['gateway-http']}", **metrics})

    @property
    def restarts(self) -> dict[str, int]:
        return {n: p.restarts for n, p in self._procs.items()}

    @property
    def pids(self) -> dict[str, int | None]:
        with self._lock:
            return {n: (p.popen.pid if p.popen else None) for n, p in self._procs.items()}

    @property
    def spare_pids(self) -> dict[str, int | None]:
        """Each stage process's standby (standby=True), None where it has none now."""
        with self._lock:
            return {n: (p.spare.pid if p.spare else None) for n, p in self._procs.items()}

    def standby_ready(self, name: str) -> bool:
        """Whether `name` has a standby that has finished its imports (standby=True only)."""
        p = self._procs[name]
        with self._lock:
            return p.spare is not None and p.spare.poll() is None and self._ready_file(p).exists()

    def log_tail(self, name: str, lines: int = 30) -> str:
        return log_tail(self._procs[name].log, lines)

    def healthy(self, name: str) -> bool:
        p = self._procs[name]
        return health_ok(self.endpoints.stages[name], p.cmd.health_service, tls=self.tls)

    # ---- life cycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> Stack:
        """Spawn every process (decode first, gateway last) and wait until all are SERVING."""
        if self._thread is not None:
            raise RuntimeError("this Stack was started already; make a new one")
        self.deployment.fetch_model()  # a hub id not cached (offline) fails here, before any process
        with self._lock:
            for p in self._procs.values():
                self._spawn(p)
        self._thread = threading.Thread(target=self._supervise, name="stack-supervisor", daemon=True)
        self._thread.start()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        self._supervising = True
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Block until every process is SERVING; TimeoutError past `timeout`, StageExited if one
        exits while the stack is starting."""
        deadline, pending = time.monotonic() + timeout, list(self._procs)
        while pending:
            if not self._supervising:
                self._fail_if_exited()
            pending = [n for n in pending if not self.healthy(n)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not SERVING after {timeout:.0f} s: {pending}; logs in {self.run_dir}\n"
                                   + "\n".join(f"--- {n}\n{self.log_tail(n, 10)}" for n in pending))
            if pending:
                time.sleep(0.3)

    def _fail_if_exited(self) -> None:
        for n, p in self._procs.items():
            rc = p.popen.poll() if p.popen else None
            if rc is not None:
                raise StageExited(f"{n} exited with code {rc} while starting; {p.log}:\n{self.log_tail(n)}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group (gateway first), wait up to grace_s, then SIGKILL what is left."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            for p in self._procs.values():
                self._drop_spare(p)
            procs = [p for p in reversed(self._procs.values()) if p.popen is not None]
            for p in procs:
                _signal_group(p.popen, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", p.cmd.name, grace_s)
            for p in procs:
                _signal_group(p.popen, signal.SIGKILL)  # the leader's leftovers too
                p.popen.wait()
            reap_by = time.monotonic() + GROUP_REAP_S  # children of a leader (a media pool's workers) are
            for p in procs:                            # reaped by init once orphaned: stop returns after that
                while _group_alive(p.popen.pid) and time.monotonic() < reap_by:
                    time.sleep(0.02)
            if self._forks is not None:
                self._forks.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- instances that come and go ------------------------------------------------------------------
    def add_instance(self, stage: str, worker: Worker | None = None, timeout: float = 300.0) -> str:
        """Start one more `stage` instance (`worker`, default: like the deployment's first one)
        and, once it is SERVING, list it in its callers' peers files. Returns its name."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        workers = getattr(self.deployment, stage)
        if worker is None and not workers:
            raise ValueError(f"the deployment has no {stage} worker to copy; pass worker=Worker(...)")
        w = (worker or workers[0]).check(stage, f"{stage} (added)")
        with self._lock:
            name = f"{stage}-{self._next_index[stage]}"
            self._next_index[stage] += 1
            port = w.port or free_port(self.host)
            cmd = stage_command(self.deployment, stage, w, name, self.host, port, self._addrs(), self._python)
            p = _Proc(self._extras(cmd), self.run_dir / f"{name}.log", listed=False)
            self._give_peers_file(p)
            self._procs[name], self.ports[name] = p, port
            self._write_peers_files()
            self._spawn(p)
        try:
            self._wait_serving(name, timeout)
        except BaseException:
            self.remove_instance(name, notice_s=0.0)
            raise
        with self._lock:
            p.listed = True
            self._write_peers_files()
        log.info("added %s on port %d", name, port)
        return name

    def remove_instance(self, name: str, notice_s: float = 1.0, timeout: float | None = None) -> int:
        """Unlist `name` from its callers' peers files, wait `notice_s` (they read them again
        every poll), then drain it: SIGTERM (the stage turns NOT_SERVING, refuses new calls
        UNAVAILABLE, lets every accepted call finish and exits), SIGKILL past `timeout`
        (default: its drain's own bound, `command_stop_s`, and a margin). Returns its exit
        code (0: drained)."""
        with self._lock:
            p = self._procs.get(name)
            if p is None or name == "gateway":
                raise ValueError(f"no removable instance {name!r}; running: "
                                 f"{', '.join(n for n in self._procs if n != 'gateway')}")
            if p.listed and not any(q.listed and q.cmd.stage == p.cmd.stage for q in self._procs.values()
                                    if q is not p):
                raise ValueError(f"{name} is the last {p.cmd.stage} instance; add another one first")
            p.listed = False
            self._write_peers_files()
        time.sleep(notice_s)
        with self._lock:
            del self._procs[name]
            self.ports.pop(name, None)
            self._drop_spare(p)  # its standby (standby=True) goes with it
        _signal_group(p.popen, signal.SIGTERM)
        timeout = command_stop_s(p.cmd) + 10.0 if timeout is None else timeout
        try:
            rc = p.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not drain in %.0f s; killing it", name, timeout)
            rc = None
        _signal_group(p.popen, signal.SIGKILL)
        rc2 = p.popen.wait()
        log.info("removed %s (exit code %s)", name, rc2 if rc is None else rc)
        return rc2 if rc is None else rc

    def _wait_serving(self, name: str, timeout: float) -> None:
        p, deadline = self._procs[name], time.monotonic() + timeout
        while not self.healthy(name):
            rc = p.popen.poll()
            if rc is not None:
                raise StageExited(f"{name} exited with code {rc} while starting; {p.log}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not SERVING after {timeout:.0f} s:\n{self.log_tail(name, 10)}")
            time.sleep(0.3)

    def _addrs(self) -> dict[str, list[str]]:
        """stage -> the addresses of its listed instances, in launch order."""
        peer = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        out: dict[str, list[str]] = {}
        for p in self._procs.values():
            if p.listed:
                out.setdefault(p.cmd.stage, []).append(f"{peer}:{p.cmd.port}")
        return out

    def _roles(self, p: _Proc) -> dict[str, tuple[str, ...]]:
        return peer_roles(p.cmd.stage, "--colocate-prefill" in p.cmd.argv)

    def _give_peers_file(self, p: _Proc) -> None:
        if self._roles(p):
            p.peers_file = self.run_dir / f"{p.cmd.name}.peers.json"
            p.cmd = dataclasses.replace(p.cmd, argv=(*p.cmd.argv, "--peers-file", str(p.peers_file)))

    def _write_peers_files(self) -> None:
        addrs = self._addrs()
        for p in self._procs.values():
            if p.peers_file is not None:
                write_peers_file(p.peers_file, peer_lists(self._roles(p), addrs))

    # ---- processes ------------------------------------------------------------------------------
    def _popen(self, p: _Proc, argv: tuple[str, ...], what: str, stdin) -> subprocess.Popen | ForkedProcess:
        env = {**dict(p.cmd.env), **os.environ, "PYTHONUNBUFFERED": "1", **self._env}  # the command's are defaults
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(_REPO), env.get("PYTHONPATH", "")) if x)
        fork = self.fork and stdin is subprocess.DEVNULL and forkable(argv, self._python)
        if fork and (self._forks is None or not self._forks.alive):
            self._forks = ForkServer(self._python, env, str(_REPO), str(self.run_dir / "fork-server.log"))
        with open(p.log, "ab") as out:
            out.write(f"=== {time.strftime('%H:%M:%S')} {what}{' (forked)' if fork else ''}: {' '.join(argv)}\n".encode())
            out.flush()
            if fork:
                return self._forks.spawn(argv, str(p.log), env, str(_REPO))
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=stdin,
                                    env=env, cwd=str(_REPO), start_new_session=True)

    def _spawn(self, p: _Proc) -> None:
        """Start the process: promote its standby when one is ready, else a fresh one."""
        spare, p.spare = p.spare, None
        if spare is not None and spare.poll() is not None:
            spare.stdin.close()
            spare = None
        if spare is not None:
            try:
                spare.stdin.write(b"go\n")
                spare.stdin.close()
                with open(p.log, "ab") as out:
                    out.write(f"=== {time.strftime('%H:%M:%S')} start #{p.restarts}: standby pid {spare.pid} "
                              f"promoted\n".encode())
                p.popen = spare
            except OSError:  # it died meanwhile
                _signal_group(spare, signal.SIGKILL)
                spare.wait()
                spare = None
        if spare is None:
            p.popen = self._popen(p, p.cmd.argv, f"start #{p.restarts}", subprocess.DEVNULL)
        p.started, p.restart_at, p.served, p.checked_at = time.monotonic(), None, False, 0.0

    def _spawn_spare(self, p: _Proc) -> None:
        ready = self._ready_file(p)
        ready.unlink(missing_ok=True)
        argv = (p.cmd.argv[0], "-m", "hasctl.standby", str(ready), *p.cmd.argv[2:])  # python -m services.X ...
        p.spare = self._popen(p, argv, "standby", subprocess.PIPE)

    def _ready_file(self, p: _Proc) -> Path:
        return self.run_dir / f"{p.cmd.name}.standby-ready"

    def _tend_spare(self, p: _Proc, now: float) -> None:
        if p.spare is not None and p.spare.poll() is not None:
            log.warning("the standby of %s exited with code %s; %s restarts cold from now on (see %s)",
                        p.cmd.name, p.spare.returncode, p.cmd.name, p.log)
            self._drop_spare(p)
            p.spare_broken = True
        if p.spare is None and not p.spare_broken and now - p.started > _SPARE_AFTER_S:
            self._spawn_spare(p)  # once the running one is settled: not competing with its start

    @staticmethod
    def _drop_spare(p: _Proc) -> None:
        if p.spare is not None:
            _signal_group(p.spare, signal.SIGKILL)
            p.spare.wait()
            p.spare.stdin.close()
            p.spare = None

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            if not (self._supervising and self.restart):
                continue
            with self._lock:
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                for p in self._procs.values():
                    self._tend(p, now)
                unseen = [(n, p, p.popen) for n, p in self._procs.items() if p.popen is not None and not p.served
                          and p.popen.poll() is None and now - p.checked_at >= _SERVED_POLL_S]
                stages = dict(self.endpoints.stages) if unseen else {}
            for name, p, popen in unseen:  # outside the lock: a health call may take its timeout
                p.checked_at = time.monotonic()
                if name in stages and health_ok(stages[name], p.cmd.health_service, timeout=0.5, tls=self.tls):
                    with self._lock:
                        if p.popen is popen:  # still the same run
                            p.served = True

    def _tend(self, p: _Proc, now: float) -> None:
        rc = p.popen.poll() if p.popen else None
        if rc is None:
            if self.standby:
                self._tend_spare(p, now)
            return
        if p.restart_at is None:  # a run that served (or lived a minute) died of a fault, not a crash loop
            p.failures = 0 if p.served or now - p.started > 60.0 else p.failures + 1
            delay = min(self.backoff_s[1], self.backoff_s[0] * 2 ** max(0, p.failures - 1))
            p.restart_at = now + delay
            _signal_group(p.popen, signal.SIGKILL)
            log.warning("%s exited with code %s; restarting in %.1f s", p.cmd.name, rc, delay)
        elif now >= p.restart_at:
            reclaim_stale()  # the dead one's shm slab, if its resource tracker died with it
            p.restarts += 1
            self._spawn(p)


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(popen: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
