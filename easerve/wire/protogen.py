"""Generate the easerve.v1 stubs (Python package easerve.wire.v1) from protos/easerve/v1 (or check they are current).

    python -m easerve.wire.protogen           # regenerate easerve/wire/v1/*_pb2*.py[i]
    python -m easerve.wire.protogen --check   # regenerate into a temp dir, diff, exit 1 on drift

Protos are compiled with `-I protos`, so protoc writes `import "easerve/v1/common.proto"` as
`from easerve.v1 import common_pb2`; the rewrite step below moves every such import (and a bare
`import common_pb2`) to the stubs' Python package, `from easerve.wire.v1 import common_pb2`.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "easerve" / "v1"
STUB_DIR = ROOT / "easerve" / "wire" / "v1"
PACKAGE = "easerve.wire.v1"
PROTO_PACKAGE = "easerve.v1"  # the protos' own package (service and message names on the wire)
_GENERATED = re.compile(r".*_pb2(_grpc)?\.pyi?$")
_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into out_dir/easerve/v1; return the generated files."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    rels = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *rels]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {rels}")
    files = sorted(p for p in (out_dir / "easerve" / "v1").iterdir() if _GENERATED.match(p.name))
    for f in files:
        f.write_text(rewrite_imports(f.read_text()))
    return files


def rewrite_imports(text: str) -> str:
    """Put the stubs in their Python package (`easerve.wire.v1`): sibling imports
    (`import x_pb2 as y`, `from easerve.wire.v1 import x_pb2`) and the generated module names
    (`'easerve.v1.x_pb2'`) move there; service and message names keep the protos' package."""
    text = _BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)
    text = re.sub(rf"^from {re.escape(PROTO_PACKAGE)} import", f"from {PACKAGE} import", text, flags=re.M)
    return re.sub(rf"'{re.escape(PROTO_PACKAGE)}\.(\w+_pb2)'", rf"'{PACKAGE}.\1'", text)


def committed() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(STUB_DIR.iterdir()) if _GENERATED.match(p.name)}


def drift() -> list[str]:
    """Unified diffs between committed stubs and freshly generated ones (empty = current)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    old = committed()
    diffs = []
    for name in sorted(set(fresh) | set(old)):
        a, b = old.get(name, ""), fresh.get(name, "")
        if a != b:
            diffs.append("".join(difflib.unified_diff(
                a.splitlines(True), b.splitlines(True), f"committed/{name}", f"generated/{name}")))
    return diffs


def write() -> list[Path]:
    """Regenerate the committed stubs in place (stale generated files are removed)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for old in STUB_DIR.iterdir():
            if _GENERATED.match(old.name):
                old.unlink()
        STUB_DIR.mkdir(parents=True, exist_ok=True)
        init = STUB_DIR / "__init__.py"
        if not init.exists():
            init.write_text("")
        written = []
        for f in fresh:
            dst = STUB_DIR / f.name
            dst.write_text(f.read_text())
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m easerve.wire.protogen", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="diff against a fresh generation; exit 1 on drift")
    args = ap.parse_args(argv)
    if args.check:
        diffs = drift()
        for d in diffs:
            print(d)
        print("stubs are current" if not diffs else
              f"{len(diffs)} stub file(s) drifted: run `python -m easerve.wire.protogen`", file=sys.stderr)
        return 1 if diffs else 0
    for p in write():
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
