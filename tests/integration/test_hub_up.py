"""`hasctl up --model Org/Name` (the CLI, a subprocess) with HF_HUB_OFFLINE=1 and HF_HOME a
pre-populated hub cache (tests/support/hub_cache.py): two encode instances, a prefill, a decode and the
gateway each resolve the hub id to the cached snapshot and read only their own shard; a chat
completion comes back under the served name Org/Name. Without the snapshot, `up` fails at once
and names the command that downloads it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from easerve.models.tiny import cached_tiny
from tests.support.hub_cache import ENCODER_SHARD, populate_hub
from tests.support.procs import stop_process

READ = re.compile(r"read (\d+) of (\d+) tensors \(\d+ parameters\) from (\S+): (.*)$")


def offline_env(hf_home) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub")}


def test_missing_snapshot_fails_at_once_naming_the_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hasctl.cli", "up", "--model", "Org/Missing@v3", "--run-dir",
                          str(tmp_path / "run")], env=offline_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "hf download Org/Missing --revision v3" in out.stderr
    assert "starting" not in out.stdout  # no process was launched
    assert not list((tmp_path / "run").glob("*.log"))


@pytest.mark.slow
def test_hasctl_up_serves_a_hub_id_from_the_offline_cache(tiny_root, tmp_path):
    snap = populate_hub(tmp_path / "hf", cached_tiny("qwen2.5-vl", tiny_root))
    encoder = {"device": "cpu", "flags": {"threads": 1, "max-batch": 4}}
    deployment = tmp_path / "two-encode.json"
    deployment.write_text(json.dumps({"name": "hub-two-encode", "encode": [encoder, encoder],
                                      "prefill": [{"device": "cpu", "flags": {"threads": 1}}],
                                      "decode": [{"device": "cpu", "flags": {"threads": 1}}]}))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hasctl.cli", "up", "--model", "Org/Name", "--deployment",
                             str(deployment), "--http-port", "0", "--grpc-port", "0", "--run-dir", str(run_dir)],
                            env=offline_env(tmp_path / "hf"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        base, seen, deadline = None, [], time.monotonic() + 420
        for line in proc.stdout:
            seen.append(line)
            if m := re.search(r"OpenAI HTTP : (\S+)", line):
                base = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        assert base, "hasctl up did not come up:\n" + "".join(seen[-40:])
        models = json.loads(urllib.request.urlopen(base + "/models", timeout=30).read())
        assert [m["id"] for m in models["data"]] == ["Org/Name"]
        body = {"model": "Org/Name", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello"}]}
        req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert out["model"] == "Org/Name" and out["usage"]["completion_tokens"] == 4
        weight_map = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
        encoder_keys = sum(1 for f in weight_map.values() if f == ENCODER_SHARD)
        for name in ("encode-0", "encode-1"):  # each opened the encoder shard of the snapshot, nothing else
            reads = [READ.search(x) for x in (run_dir / f"{name}.log").read_text().splitlines()]
            reads = [m for m in reads if m]
            assert [(int(m[1]), int(m[2]), m[3], m[4]) for m in reads] == \
                [(encoder_keys, encoder_keys, str(snap), "model.visual")], name
    finally:
        stop_process(proc)
