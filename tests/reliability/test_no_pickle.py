"""No unpickling anywhere in the code: every .py file of the repository (not .venv) is parsed
and each call that can run a pickle (pickle / cPickle / dill / marshal loads, Unpickler,
`torch.load` without `weights_only=True`, `np.load(allow_pickle=True)`, pandas.read_pickle,
joblib.load) fails the test with its file:line. Network bytes must stay data, never code."""
from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", "venv", ".git", "node_modules", "__pycache__", "build", "dist", ".tox", ".eggs"}
UNPICKLERS = {f"{m}.{f}" for m in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle")
              for f in ("load", "loads", "Unpickler")} | {
    "marshal.load", "marshal.loads", "pandas.read_pickle", "joblib.load", "shelve.open"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for (import x as y; from x import a as b)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(func: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    parts.append(aliases.get(func.id, func.id))
    name = ".".join(reversed(parts))
    return {"np": "numpy", "pd": "pandas"}.get(name.split(".")[0], name.split(".")[0]) + name[len(name.split(".")[0]):]


def _kw_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def violations(source: str, filename: str = "<string>") -> list[str]:
    tree = ast.parse(source, filename)
    aliases, out = _aliases(tree), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        why = None
        if name in UNPICKLERS:
            why = f"{name}() unpickles"
        elif name == "torch.load" and not _kw_true(node, "weights_only"):
            why = "torch.load() without weights_only=True unpickles"
        elif name == "numpy.load" and _kw_true(node, "allow_pickle"):
            why = "numpy.load(allow_pickle=True) unpickles"
        if why:
            out.append((node.lineno, f"{filename}:{node.lineno}: {why}"))
    return [v for _, v in sorted(out)]


def python_files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]  # not into .venv
        out += [Path(root, f) for f in files if f.endswith(".py")]
    return out


def test_the_scanner_finds_each_kind_of_unpickling():
    src = """
import pickle, torch, dill, marshal
import numpy as np
import pickle as pk
from pickle import loads as L
from torch import load
pickle.loads(b"")
pk.load(f)
L(b"")
dill.loads(b"")
marshal.loads(b"")
pickle.Unpickler(f).load()
torch.load("x")
torch.load("x", weights_only=False)
load("x")
np.load("x", allow_pickle=True)
torch.load("x", weights_only=True)
np.load("x")
pickle.dumps(1)
"""
    found = violations(src, "sample.py")
    assert [int(v.split(":")[1]) for v in found] == list(range(7, 17)), found
    assert found[0] == "sample.py:7: pickle.loads() unpickles"


def test_no_file_of_the_repository_unpickles():
    files = python_files()
    assert len(files) > 100 and any(p.name == "tls.py" for p in files), "the scan did not see the code"
    found = [v for p in files for v in violations(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert not found, "unpickling in the code (network bytes must never run as code):\n" + "\n".join(found)
