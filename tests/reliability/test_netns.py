"""Multi-host, on one machine: the stages in three network namespaces joined by veth pairs
on a bridge (made here, namespace-local addresses only, the host's own network untouched):

    ns A  10.77.0.1   gateway + encode      (the client runs here too)
    ns B  10.77.0.2   remote prefill        embeddings A -> B over gRPC
    ns C  10.77.0.3   decode                KV B -> C over the gRPC stream, tokens C -> A
    hub   br0         the three veth peers

The namespaces share /dev/shm (one mount namespace), so `--kv-transport auto` would pick
shm; prefill is told `--kv-transport grpc` and its log must say so. Cutting decode's link
(its veth at the bridge) mid-request ends the request with UNAVAILABLE naming the decode
instance before its deadline (the stage channels' keepalive finds the silent link); bringing the link back brings the service back. Skipped, saying why,
where network namespaces cannot be made (not root, no `ip`, no CAP_SYS_ADMIN).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from easerve.models.tiny import cached_tiny
from easerve.stages.common.configs import DecodeConfig, EncodeConfig, GatewayConfig, PrefillConfig
from easerve.stages.common.argv import to_argv

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
IPS = {"a": "10.77.0.1", "b": "10.77.0.2", "c": "10.77.0.3"}
DEADLINE_S = 15.0
SLACK_S = 5.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Namespaces:
    """ns-a, ns-b, ns-c and a hub with bridge br0; `cut(x)` / `restore(x)` take x's link down / up."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {k: f"es-{tag}-{k}" for k in (*IPS, "hub")}
        self.made: list[str] = []

    def make(self) -> None:
        for name in self.ns.values():
            ip("netns", "add", name)
            self.made.append(name)
        hub = self.ns["hub"]
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for k, addr in IPS.items():
            ns = self.ns[k]
            ip("-n", hub, "link", "add", f"h{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", hub, "link", "set", f"h{k}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def cut(self, k: str) -> None:
        ip("-n", self.ns["hub"], "link", "set", f"h{k}", "down")

    def restore(self, k: str) -> None:
        ip("-n", self.ns["hub"], "link", "set", f"h{k}", "up")

    def delete(self) -> None:
        for name in reversed(self.made):
            ip("netns", "del", name, check=False)
        self.made.clear()


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this host"
    probe = f"es-probe-{uuid.uuid4().hex[:6]}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


class Procs:
    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir, self.env, self.procs = run_dir, env, {}

    def start(self, name: str, ns: str, argv: list[str]) -> None:
        log = open(self.run_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, cwd=str(REPO),
                                            start_new_session=True)
        log.close()

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            with _suppress():
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with _suppress():
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError))


def stage_commands(model: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (namespace key, argv): each stage listens on its namespace's address only."""
    a, b, c = IPS["a"], IPS["b"], IPS["c"]
    py = [sys.executable, "-m"]
    common = dict(model=model, threads=1)
    dec = DecodeConfig(listen=f"{c}:50054", num_slots=4, max_seq_len=4096, **common)
    pre = PrefillConfig(listen=f"{b}:50053", decode=(f"{c}:50054",), kv_transport="grpc", **common)
    enc = EncodeConfig(listen=f"{a}:50052", prefill=(f"{b}:50053",), **common)
    gw = GatewayConfig(model=model, listen=f"{a}:50051", http_listen=f"{a}:8000", encode=(f"{a}:50052",),
                       prefill=(f"{b}:50053",), decode=(f"{c}:50054",))
    return {"decode": ("c", [*py, "services.decode", *to_argv(dec)]),
            "prefill": ("b", [*py, "services.prefill", *to_argv(pre)]),
            "encode": ("a", [*py, "services.encode", *to_argv(enc)]),
            "gateway": ("a", [*py, "services.gateway", *to_argv(gw)])}


def client(ns: str, env: dict, *args: str, timeout: float = 120) -> list[dict]:
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.reliability.netns_client", *args],
                       capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, f"client printed nothing (rc {r.returncode}): {r.stderr[-2000:]}"
    return lines


@pytest.mark.load  # ~30 s; a cut link, with the long fault tests
def test_stages_in_separate_namespaces_survive_a_cut_link(tmp_path):
    why = _cannot_make_namespaces()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    root = os.environ.get("EASERVE_TINY_CACHE") or str(tmp_path / "tiny")
    model = str(cached_tiny("qwen2.5-vl", root))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EASERVE_LOG_LEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)}
    nets, procs = Namespaces(), Procs(tmp_path, env)
    try:
        nets.make()
        gw = f"{IPS['a']}:50051"
        for name, (k, argv) in stage_commands(model).items():
            procs.start(name, nets.ns[k], argv)
        addrs = [gw, f"{IPS['a']}:50052", f"{IPS['b']}:50053", f"{IPS['c']}:50054"]
        up = client(nets.ns["a"], env, "wait", "420", *addrs, timeout=480)[-1]
        assert up["pending"] == [], "not SERVING: " + "\n".join(f"--- {n}\n{procs.log(n)[-1500:]}" for n in procs.procs)

        # across the namespaces: text (prefill -> decode KV) and an image (encode -> prefill embeddings)
        assert client(nets.ns["a"], env, "generate", gw)[-1]["tokens"] == 6
        assert client(nets.ns["a"], env, "generate", gw, "--image")[-1]["tokens"] == 6
        assert f"KV to {IPS['c']}:50054 over grpc" in procs.log("prefill")

        # cut decode's link mid-request: a clear error within the deadline
        cmd = ["ip", "netns", "exec", nets.ns["a"], sys.executable, "-m", "tests.reliability.netns_client",
               "stream", gw, str(DEADLINE_S), "3000"]
        streaming = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=str(REPO))
        lines = []
        for raw in streaming.stdout:
            lines.append(json.loads(raw))
            if lines[-1].get("tokens", 0) >= 3 and "error" not in lines[-1]:
                break
        t_cut = time.monotonic()
        nets.cut("c")
        rest = [json.loads(x) for x in streaming.stdout]
        streaming.wait(DEADLINE_S + SLACK_S + 30)
        cut_to_error = time.monotonic() - t_cut
        end = (lines + rest)[-1]
        assert end["error"] == "UNAVAILABLE", end  # keepalive (5 s + 5 s) finds it, not the deadline
        assert f"decode instance {IPS['c']}:50054" in end["message"], end
        assert end["elapsed_s"] < DEADLINE_S, end

        # restore it: service comes back
        nets.restore("c")
        deadline, out = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            out = client(nets.ns["a"], env, "generate", gw)[-1]
            if out.get("tokens") == 6:
                break
            time.sleep(1)
        assert out and out.get("tokens") == 6, f"service did not come back after the link was restored: {out}"
        print(f"\nnetns: cut after {lines[-1]['tokens']} tokens -> {end['error']} '{end['message'][:120]}' "
              f"{cut_to_error:.1f} s after "
              f"the cut ({end['elapsed_s']:.1f} s into a {DEADLINE_S:.0f} s deadline)")
    finally:
        procs.stop()
        nets.delete()
    assert not any(n in ip("netns", "list").stdout for n in nets.ns.values()), "a namespace was left behind"
