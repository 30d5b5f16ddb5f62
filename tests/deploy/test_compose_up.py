"""The image builds and the CPU compose stack (docker-compose.cpu.yml) serves, with podman.

Builds the local Debian base (scripts/build-base-image.sh, when absent) and the image
(scripts/build-image.sh, reusing the layer cache), brings the stack up with podman-compose on
host networking with free ports, sends an image request and a streamed request to the
gateway on 127.0.0.1, and always takes the stack down (containers, pod and volume).

Start order: podman-compose honours `depends_on: condition: service_healthy` only with podman
>= 4.6, and podman runs health checks on a timer only under systemd; so the test brings the
services up one at a time in the compose file's dependency order and waits for each one's own
compose health check (`podman healthcheck run`) before starting the next. The dependency graph
itself is checked in tests/unit/test_compose.py.

Skipped, with the reason, only where no container engine can run here: podman or
podman-compose missing, or `podman info` failing. CI (.ci/run) installs podman, runc and
debootstrap when it runs as root; the test installs nothing itself.
"""
from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hasctl.compose import TINY_MODEL_NAME
from hasctl.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.cpu.yml"
BASE = os.environ.get("EASERVE_TEST_BASE", "localhost/debian-base:bookworm")
IMAGE = os.environ.get("EASERVE_TEST_IMAGE", "localhost/easerve:test")

# the first test also builds (the fixture): up to ~10 min cold on 2 cores, past pyproject's 600 s
pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    if shutil.which("runc") and "CONTAINERS_CONF" not in env:
        env["CONTAINERS_CONF"] = str(ROOT / "tests/deploy/containers.conf")
    return env


def _why_no_engine() -> str | None:
    if not shutil.which("podman"):
        return "podman is not installed (apt-get install podman runc debootstrap; .ci/run does it as root)"
    if not (Path(sys.executable).parent / "podman-compose").exists() and not shutil.which("podman-compose"):
        return "podman-compose is not installed (pip install -e '.[dev]')"
    r = subprocess.run(["podman", "info"], capture_output=True, text=True, env=_engine_env())
    if r.returncode != 0:
        return f"`podman info` fails here: {r.stderr.strip()[-300:]}"
    r = subprocess.run(["podman", "image", "exists", BASE], env=_engine_env())
    if r.returncode != 0 and not (shutil.which("debootstrap") and os.geteuid() == 0):
        return f"no base image {BASE} and no way to build one (needs root and debootstrap)"
    return None


def _run(cmd: list[str], env: dict, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def _compose_cmd() -> list[str]:
    local = Path(sys.executable).parent / "podman-compose"
    return [str(local) if local.exists() else "podman-compose"]


def _start_order(services: dict) -> list[str]:
    """Services so that each comes after everything it depends on (the file's own graph)."""
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n, s in services.items() if n not in done and set(s.get("depends_on", {})) <= set(done)]
        assert ready, f"depends_on has a cycle among {sorted(set(services) - set(done))}"
        done += ready
    return done


def _png() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 40, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def image() -> dict[str, float]:
    """Builds the base (when absent) and the image; returns how long each took."""
    why = _why_no_engine()
    if why:
        pytest.skip(why)
    env = _engine_env()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    _run([str(ROOT / "scripts/build-base-image.sh")], {**env, "IMAGE": BASE}, timeout=900)
    timings["base_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    _run([str(ROOT / "scripts/build-image.sh")], {**env, "IMAGE": IMAGE, "BASE": BASE, "PYTHON": sys.executable},
         timeout=1800)
    timings["image_s"] = time.monotonic() - t0
    return timings


@pytest.fixture(scope="module")
def stack(image):
    env = _engine_env()
    timings = dict(image)

    project = f"easerve-test-{os.getpid()}"
    ports = {name: free_port() for name in ("EASERVE_PORT_DECODE_0", "EASERVE_PORT_PREFILL_0",
                                            "EASERVE_PORT_ENCODE_0", "EASERVE_GRPC_PORT", "EASERVE_HTTP_PORT")}
    env = {**env, **{k: str(v) for k, v in ports.items()}, "EASERVE_IMAGE": IMAGE}
    compose = [*_compose_cmd(), "-p", project, "-f", str(COMPOSE)]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    t0 = time.monotonic()
    try:
        for name in _start_order(services):
            _run([*compose, "up", "-d", name], env, timeout=300)
            _wait_healthy(f"{project}_{name}_1", env, timeout=600)
        timings["up_s"] = time.monotonic() - t0
        print(f"\ncompose stack timings: {', '.join(f'{k} {v:.0f}' for k, v in timings.items())}")
        yield {"http": f"http://127.0.0.1:{ports['EASERVE_HTTP_PORT']}", "project": project, "env": env,
               "compose": compose}
    finally:
        _run([*compose, "down", "-v", "-t", "20"], env, timeout=300, check=False)
        left = _run(["podman", "ps", "-aq", "--filter", f"label=io.podman.compose.project={project}"], env, 60,
                    check=False).stdout.split()
        if left:
            _run(["podman", "rm", "-f", *left], env, timeout=120, check=False)
        _run(["podman", "volume", "rm", "-f", f"{project}_models"], env, timeout=60, check=False)


def _wait_healthy(container: str, env: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = _run(["podman", "healthcheck", "run", container], env, timeout=60, check=False)
        if r.returncode == 0:
            return
        state = _run(["podman", "inspect", "-f", "{{.State.Status}}", container], env, 30, check=False).stdout.strip()
        if state not in ("running", "created", "configured") or time.monotonic() > deadline:
            logs = _run(["podman", "logs", "--tail", "40", container], env, 60, check=False)
            raise AssertionError(f"{container} is {state}, not healthy ({r.stdout.strip()} {r.stderr.strip()}):\n"
                                 f"{logs.stdout}{logs.stderr}")
        time.sleep(2)


def test_the_image_serves_its_tiny_model_with_no_volume(image):
    env, port, name = _engine_env(), free_port(), f"easerve-test-novolume-{os.getpid()}"
    _run(["podman", "run", "-d", "--rm", "--network", "host", "--name", name, IMAGE, "python", "-m",
          "services.decode", "--model", "/models", "--device", "cpu", "--listen", f"127.0.0.1:{port}"], env, 120)
    try:
        from easerve.healthcheck import check
        deadline, status = time.monotonic() + 300, ""
        while time.monotonic() < deadline and status != "SERVING":
            time.sleep(1)
            status = check(f"127.0.0.1:{port}", "easerve.v1.Decode", timeout=2)
        assert status == "SERVING", _run(["podman", "logs", name], env, 60, check=False).stderr[-2000:]
    finally:
        _run(["podman", "rm", "-f", "-t", "5", name], env, timeout=120, check=False)


def _client(stack):
    import openai
    return openai.OpenAI(base_url=stack["http"] + "/v1", api_key="none", max_retries=0, timeout=120)


def _messages(image: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def test_image_request_and_stream_through_the_gateway(stack):
    client = _client(stack)
    assert [m.id for m in client.models.list().data] == [TINY_MODEL_NAME]
    image = _png()
    whole = client.chat.completions.create(model=TINY_MODEL_NAME, messages=_messages(image), max_tokens=12,
                                           temperature=0)
    assert whole.usage.prompt_tokens > 20          # the image's placeholder tokens reached the model
    assert 1 <= whole.usage.completion_tokens <= 12
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=TINY_MODEL_NAME, messages=_messages(image), max_tokens=12,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 1
    assert text == whole.choices[0].message.content  # greedy: the stream and the whole answer agree
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_every_service_is_healthy_and_the_kv_went_through_shared_memory(stack):
    env = stack["env"]
    names = _run(["podman", "ps", "--format", "{{.Names}}", "--filter",
                  f"label=io.podman.compose.project={stack['project']}"], env, 60).stdout.split()
    assert sorted(n.split("_")[1] for n in names) == ["decode-0", "encode-0", "gateway", "prefill-0"]
    for n in names:
        assert _run(["podman", "healthcheck", "run", n], env, 60, check=False).returncode == 0, n
    # prefill was told --kv-transport shm; a request only succeeds when decode can map the segment
    # (the containers share /dev/shm), so the earlier request proves it; check the mount is the host's.
    r = _run(["podman", "exec", f"{stack['project']}_prefill-0_1", "sh", "-c", "df -k /dev/shm | tail -1"], env, 60)
    host = subprocess.run(["sh", "-c", "df -k /dev/shm | tail -1"], capture_output=True, text=True).stdout
    assert r.stdout.split()[1] == host.split()[1]  # same size: the host's /dev/shm, not a private 64 MB one
