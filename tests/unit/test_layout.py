"""The tree keeps the layout docs/layout.md shows: stages meet in the library, never in an entry point."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("easerve", "services", "hasctl", "bench", "scripts", "tests")


def _python_files():
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            if "/wire/v1/" not in path.as_posix():
                yield path


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_module_imports_an_entry_point():
    offenders = [f"{p.relative_to(ROOT)} imports {m}" for p in _python_files()
                 for m in sorted(_imported_modules(p)) if m.split(".")[-1] == "__main__"]
    assert offenders == []


def test_entry_points_only_wire():
    """services/<stage>/__main__.py parses the config and calls its stage package: nothing else."""
    for main in sorted((ROOT / "services").glob("*/__main__.py")):
        stage = main.parent.name
        mods = _imported_modules(main)
        assert f"easerve.stages.{stage}.app" in mods, main
        assert not [m for m in mods if m.startswith("services")], main
        assert len(main.read_text().splitlines()) <= 40, f"{main} holds more than an entry point"
    assert sorted(p.name for p in (ROOT / "services").iterdir() if p.is_dir() and p.name != "__pycache__") == \
        ["decode", "encode", "gateway", "monolith", "prefill"]


def _layout_paths() -> list[str]:
    layout = (ROOT / "docs" / "layout.md").read_text()
    block = re.search(r"^# Layout\n.*?```\n(.*?)```", layout, re.S | re.M).group(1)
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def test_layout_doc_matches_the_tree():
    paths = _layout_paths()
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == [], f"docs/layout.md names paths that do not exist: {missing}"
    listed = {p.rstrip("/") for p in paths}
    packages = [d for d in (ROOT / "easerve").iterdir() if (d / "__init__.py").exists()]
    packages += [d for d in (ROOT / "easerve" / "stages").iterdir() if (d / "__init__.py").exists()]
    unlisted = sorted(str(d.relative_to(ROOT)) for d in packages
                      if str(d.relative_to(ROOT)) not in listed and d.name != "stages")
    assert unlisted == [], f"packages docs/layout.md does not show: {unlisted}"


def test_architecture_doc_names_only_existing_modules():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in set(re.findall(r"`((?:easerve|services|hasctl)/[\w/.]+)`", doc)):
        assert (ROOT / path.rstrip("/")).exists(), f"docs/architecture.md names {path}, which does not exist"


def test_hasctl_commands_register_their_own_names():
    import argparse
    import importlib

    from hasctl.cli import COMMANDS

    for name, module in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"hasctl.{module}").add_parser(sub)
        assert list(sub.choices) == [name], f"hasctl/{module}.py registers {list(sub.choices)}, cli.py expects {name}"


def test_simulate_command_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from hasctl.cli import build_parser; build_parser(['simulate', '--help']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
