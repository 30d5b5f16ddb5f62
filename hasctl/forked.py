"""Stage processes forked from a process that has done their imports once.

Most of a cold stage process's start is importing torch, transformers and the stage's code,
before it loads a model (`bench/restart_cost.py` measures each way of restarting side by side).
A `hasctl.launch.Stack` with `fork=True` runs one fork server, `python -m hasctl.forked`,
which imports every stage entry point (`services.<stage>.__main__`) once and then forks each
stage process, and each restart, from itself: a restart costs the model load, and no standby
sits beside each stage process.

The fork server reads one JSON request per line on stdin ({"argv", "log", "env", "cwd"}),
forks, and writes {"pid"} back, later {"pid", "exit"} when that child ends (JSON only: no
pickles). A child starts its own session (its pid names its process group, as with
`start_new_session`), writes stdout and stderr to its log, takes the request's environment
and runs `python -m services.<stage> ARGS...` in place, exiting as that process would.
On end of input the server exits; its children are the launcher's to stop.
`ForkedProcess` is the launcher's handle on one child: the part of `subprocess.Popen` it uses.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping

PRELOAD = tuple(f"services.{s}.__main__" for s in ("encode", "prefill", "decode", "gateway"))
_SPAWN_WAIT_S = 300.0  # the first request waits for the server's imports


def forkable(argv: tuple[str, ...], python: str) -> bool:
    """Whether `argv` is `<python> -m services.<stage> ...`."""
    return len(argv) >= 3 and argv[0] == python and argv[1] == "-m" and argv[2].startswith("services.")


# ---- the fork server -----------------------------------------------------------------------------
def serve(preload: tuple[str, ...]) -> dict | None:
    """The server's loop; returns a request in a freshly forked child (None in the server at
    the end of input)."""
    for module in preload:
        importlib.import_module(module)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use the GPU
        raise RuntimeError("CUDA was initialized while importing the stage code: forked stage processes "
                           "could not use the GPU; start the stack without fork (standby or cold restarts)")
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the selector
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "request")
    sel.register(sig_r, selectors.EVENT_READ, "child")
    buf = b""
    try:
        while True:
            for key, _ in sel.select():
                if key.data == "child":
                    os.read(sig_r, 4096)
                    _reap()
                    continue
                chunk = os.read(sys.stdin.fileno(), 1 << 16)
                if not chunk:
                    return None
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        sel.close()
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.close(sig_r)
                        os.close(sig_w)
                        return req
                    _report({"pid": pid})
    finally:
        if sel.get_map() is not None:
            sel.close()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def _report(msg: dict) -> None:
    os.write(sys.stdout.fileno(), (json.dumps(msg) + "\n").encode())


def become(req: dict) -> None:
    """In the child: the stage process the request names, run in place."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv = req["argv"]
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> int:
    req = serve(tuple(argv) or PRELOAD)
    if req is not None:
        become(req)
    return 0


# ---- the launcher's side -------------------------------------------------------------------------
class ForkServer:
    """A running `python -m hasctl.forked` and the exits of its children."""

    def __init__(self, python: str, env: Mapping[str, str], cwd: str, log_path: str) -> None:
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen([python, "-m", "hasctl.forked"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, env=dict(env), cwd=cwd,
                                          start_new_session=True)
        self.python = python
        self._cond = threading.Condition()
        self._one_at_a_time = threading.Lock()  # a reply is matched to its request by order
        self._pids: list[int] = []      # replies to requests, in order
        self.exits: dict[int, int] = {}  # child pid -> exit code (Popen's convention: -N for signal N)
        self._gone = False
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self.exits[msg["pid"]] = msg["exit"]
                else:
                    self._pids.append(msg["pid"])
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return not self._gone

    def spawn(self, argv: tuple[str, ...], log_path: str, env: Mapping[str, str], cwd: str) -> ForkedProcess:
        if not forkable(argv, self.python):
            raise ValueError(f"only `{self.python} -m services.<stage> ...` can be forked, got {argv[:3]}")
        req = {"argv": list(argv), "log": log_path, "env": dict(env), "cwd": cwd}
        with self._one_at_a_time, self._cond:
            self._proc.stdin.write((json.dumps(req) + "\n").encode())
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: self._pids or self._gone, _SPAWN_WAIT_S):
                raise TimeoutError(f"the fork server did not fork within {_SPAWN_WAIT_S:.0f} s")
            if not self._pids:
                raise RuntimeError(f"the fork server exited with code {self._proc.wait()}")
            pid = self._pids.pop(0)
        child = ForkedProcess(self, pid, list(argv))
        child.wait_session()
        return child

    def close(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedProcess:
    stdin = None

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self._server._cond:
                self.returncode = self._server.exits.get(self.pid)
            if self.returncode is None and not self._server.alive and not _exists(self.pid):
                self.returncode = -signal.SIGKILL  # its server died first: the code is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            with self._server._cond:
                self._server._cond.wait(0.2 if left is None else min(0.2, left))
        return self.returncode

    def wait_session(self, timeout: float = 5.0) -> None:
        """Until the child has its own session (its pid names its process group, so a signal
        to the group reaches it); returns early once it is gone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.poll() is None:
            try:
                if os.getpgid(self.pid) == self.pid:
                    return
            except ProcessLookupError:
                return
            time.sleep(0.002)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
