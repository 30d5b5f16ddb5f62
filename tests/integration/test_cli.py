"""The command line as a user runs it: `hasctl make-tiny`, and the README's main job
`hasctl demo` (the full stack answering an SDK and an HTTP request)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hasctl.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path, capsys):
    from transformers import AutoConfig, AutoProcessor

    out = tmp_path / "ultravox"
    assert main(["make-tiny", "--family", "ultravox", "--out", str(out), "--seed", "3"]) == 0
    assert "wrote ultravox" in capsys.readouterr().out
    assert AutoConfig.from_pretrained(out).model_type == "ultravox"
    assert AutoProcessor.from_pretrained(out).tokenizer is not None
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", "--family", "gpt-2", "--out", str(tmp_path / "x")])
    assert e.value.code == 2


@pytest.mark.slow
def test_demo_runs_the_stack_and_answers(tiny_root):
    proc = subprocess.run([sys.executable, "-m", "hasctl.cli", "demo", "--cache", tiny_root, "--max-tokens", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stack up: gRPC" in proc.stdout
    m = re.search(r"\[SDK image\] (\d+) tokens", proc.stdout)
    assert m and 1 <= int(m.group(1)) <= 4, proc.stdout
    assert "[HTTP video, streamed]" in proc.stdout
