"""`hasctl up --model DIR` on the tiny checkpoint of each published hub layout (a real launch:
four processes, real sockets) answers an OpenAI request with that family's media, and each stage
process read only its own role's tensors from the checkpoint (its log says which)."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from easerve.models.tiny import cached_tiny
from tests.support.media import data_uri, png_bytes, wav_bytes
from tests.support.procs import stop_process

pytestmark = pytest.mark.slow
ROLE_MODULES = {  # family -> (encode's modules, prefill's / decode's modules)
    "llava-next": ({"model.vision_tower", "model.multi_modal_projector", "model.image_newline"},
                   {"model.language_model", "lm_head"}),
    "qwen2.5-vl": ({"model.visual"}, {"model.language_model", "lm_head"}),
    "qwen2-audio": ({"model.audio_tower", "model.multi_modal_projector"}, {"model.language_model", "lm_head"}),
    "ultravox": ({"audio_tower", "multi_modal_projector"}, {"language_model"}),
}
READ = re.compile(r"read (\d+) of (\d+) tensors \((\d+) parameters\) from (\S+): (.*)$")


def media_part(family: str) -> dict:
    if family in ("llava-next", "qwen2.5-vl"):
        return {"type": "image_url", "image_url": {"url": data_uri(png_bytes(40, 64, 1))}}
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(0.7, 330)).decode(),
                                                   "format": "wav"}}


def start_up(model: str, run_dir) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hasctl.cli", "up", "--model", model, "--http-port", "0",
                             "--grpc-port", "0", "--run-dir", str(run_dir), "--served-model-name", "layout-test"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, seen = time.monotonic() + 420, []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"OpenAI HTTP : (\S+)", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("hasctl up did not come up:\n" + "".join(seen[-40:]))


def tensor_count(folder: str) -> int:
    """How many tensors the checkpoint folder holds (its safetensors index, else its one file)."""
    from pathlib import Path

    from safetensors import safe_open
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return len(json.loads(index.read_text())["weight_map"])
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return len(list(f.keys()))


def reads(log_path) -> list[tuple[int, int, set[str]]]:
    out = []
    for line in log_path.read_text().splitlines():
        m = READ.search(line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), set(m.group(5).split(", "))))
    return out


# qwen2.5-vl in the main suite; the other families (~25 s each) with the long tests
@pytest.mark.parametrize("family", [f if f == "qwen2.5-vl" else pytest.param(f, marks=pytest.mark.load)
                                    for f in ROLE_MODULES])
def test_hasctl_up_serves_the_published_layout(tiny_root, tmp_path, family):
    model = str(cached_tiny(family, tiny_root, layout="published"))
    proc, base = start_up(model, tmp_path)
    try:
        models = json.loads(urllib.request.urlopen(base + "/models", timeout=30).read())
        assert models["data"][0]["id"] == "layout-test"
        body = {"model": "layout-test", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "messages": [
            {"role": "user", "content": [media_part(family), {"type": "text", "text": "What is this?"}]}]}
        req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        # ignore_eos: whatever the random weights pick, all 4 tokens come back and the answer stops at max_tokens
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 4 and answer["usage"]["prompt_tokens"] > 4
    finally:
        stop_process(proc)
    enc_modules, lm_modules = ROLE_MODULES[family]
    nonzero = lambda r: [x for x in r if x[0]]  # noqa: E731 - a referenced folder may have nothing left to give
    enc = nonzero(reads(tmp_path / "encode-0.log"))
    lm = [nonzero(reads(tmp_path / f"{s}-0.log")) for s in ("prefill", "decode")]
    assert enc and all(mods <= enc_modules for _, _, mods in enc), enc
    assert set().union(*(m for _, _, m in enc)) == enc_modules
    for r in lm:
        assert r and all(mods <= lm_modules for _, _, mods in r), r
        assert set().union(*(m for _, _, m in r)) == lm_modules
    assert reads(tmp_path / "gateway.log") == []  # the processor role reads no weights
    if family != "ultravox":  # one folder: encode's and the LM's tensors are all of it, each read once
        (n_enc, _, _), = enc   # each process opens only the files holding its tensors: count the folder's
        (n_lm, _, _), = lm[0]
        assert n_enc + n_lm == tensor_count(model)
