"""A stand-in for a stage process that only serves grpc health (the launcher's tests)."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path


FAKE_STAGE = """\
#!{python}
# Stands in for `python -m services.<stage> ... --listen H:P`: serves grpc health SERVING.
import os, signal, subprocess, sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

stage = sys.argv[2].split(".")[1]
if os.environ.get("FAKE_FAIL") == stage:
    print("boom: this stage cannot start", flush=True)
    sys.exit(3)
server = grpc.server(futures.ThreadPoolExecutor(2))
h = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port(sys.argv[sys.argv.index("--listen") + 1])
server.start()
for name in ("", "easerve.v1." + stage.capitalize()):
    h.set(name, health_pb2.HealthCheckResponse.SERVING)
if stage == "decode":  # a grandchild in the stage's process group must die with it
    kid = subprocess.Popen(["sleep", "600"])
    with open(os.environ["FAKE_KIDS"], "a") as f:
        f.write(f"{{kid.pid}}\\n")
if os.environ.get("FAKE_IGNORE_TERM") == stage:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: (server.stop(0), sys.exit(0)))
server.wait_for_termination()
"""


def write_fake_python(path: Path) -> str:
    """An executable at `path` that Stack can use as its python: every stage it starts is FAKE_STAGE."""
    path.write_text(textwrap.dedent(FAKE_STAGE.format(python=sys.executable)))
    path.chmod(0o755)
    return str(path)
