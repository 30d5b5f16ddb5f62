"""Generate the easerve.v1 stubs from protos/easerve/v1 (or check they are current).

    python -m easerve.protogen           # regenerate easerve/v1/*_pb2*.py[i]
    python -m easerve.protogen --check   # regenerate into a temp dir, diff, exit 1 on drift

Protos are compiled with `-I protos`, so `import "easerve/v1/common.proto"` becomes
`from easerve.v1 import common_pb2`; the rewrite step below enforces that form for
any import protoc writes differently (e.g. a bare `import common_pb2`).
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "easerve" / "v1"
STUB_DIR = ROOT / "easerve" / "v1"
PACKAGE = "easerve.v1"
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
    """Make sibling imports package-absolute: `import x_pb2 as y` -> `from easerve.v1 import x_pb2 as y`."""
    return _BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)


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
    ap = argparse.ArgumentParser(prog="python -m easerve.protogen", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="diff against a fresh generation; exit 1 on drift")
    args = ap.parse_args(argv)
    if args.check:
        diffs = drift()
        for d in diffs:
            print(d)
        print("stubs are current" if not diffs else
              f"{len(diffs)} stub file(s) drifted: run `python -m easerve.protogen`", file=sys.stderr)
        return 1 if diffs else 0
    for p in write():
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
