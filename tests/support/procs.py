"""Whether a process (or a process group) is gone."""
from __future__ import annotations

import os
from pathlib import Path


def gone(pid: int) -> bool:
    """No such process, or a zombie someone else reaps."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def stop_process(proc, timeout: float = 60) -> None:
    """SIGTERM a started command (a `subprocess.Popen`), then SIGKILL it if it is still up after `timeout`."""
    import signal
    import subprocess
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
