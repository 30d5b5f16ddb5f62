"""One import path for errors: every domain error (an `EAServeError` subclass) is defined in
`easerve.errors`, and every module of the repository imports an exception class only from
the module that defines it (no re-exports: `easerve.rpc.errors` keeps the status mapping
only). Read from the source with `ast`, nothing imported: `from X import N`, `X.N` through a
module alias, and module-level aliases (`N = errors.Overloaded`) are all followed.

The SDK's own names (`easerve.OverloadedError`, ...) stay for its users; inside the
repository nobody imports them (`from easerve import OverloadedError` is followed through the
package's lazy SDK names, easerve/__init__.py)."""
from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("easerve", "services", "hasctl", "bench", "tests")
DOMAIN_HOME = "easerve.errors"
DOMAIN_BASE = f"{DOMAIN_HOME}.EAServeError"
# a base class from outside the repository counts as an exception by its name
FOREIGN_EXC_SUFFIXES = ("Error", "Exception", "Warning", "Exit", "Interrupt")
LAZY = {"easerve": "easerve.client"}  # a package's names looked up on first access, from that module


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    bindings: dict[str, str] = field(default_factory=dict)   # imported name -> absolute dotted target
    aliases: dict[str, str] = field(default_factory=dict)    # module-level N = x.y, as written
    classes: dict[str, list[str]] = field(default_factory=dict)  # class name -> its bases, dotted


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = mod.name.split(".")
    if mod.path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _parse(path: Path, text: str | None = None) -> Module:
    """A module's imports, module-level aliases and classes (`text`: its source, else read)."""
    m = Module(_module_name(path), path, ast.parse(path.read_text() if text is None else text, str(path)))
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                m.bindings[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(m, node)
            for a in node.names:
                m.bindings[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.ClassDef):
            m.classes[node.name] = [d for d in map(_dotted, node.bases) if d is not None]
    for node in m.tree.body:  # module-level aliases: N = other.N
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (target := _dotted(node.value)) is not None:
                m.aliases[node.targets[0].id] = target
    return m


def _load() -> dict[str, Module]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                m = _parse(path)
                mods[m.name] = m
    return mods


class Index:
    def __init__(self, mods: dict[str, Module]):
        self.mods = mods

    def qualify(self, mod: Module, dotted: str) -> str:
        """A dotted name as written in `mod`, made absolute through its imports."""
        head, _, rest = dotted.partition(".")
        if head in mod.classes and head not in mod.bindings:
            base = f"{mod.name}.{head}"
        elif head in mod.bindings:
            base = mod.bindings[head]
        elif isinstance(getattr(builtins, head, None), type):
            base = f"builtins.{head}"
        else:
            base = head
        return f"{base}.{rest}" if rest else base

    def resolve(self, qual: str, depth: int = 0) -> str:
        """Follow re-exports and aliases to where a name is defined (a class's own
        `module.Class`); names that are not classes of the repository come back as given."""
        mod_name, _, name = qual.rpartition(".")
        mod = self.mods.get(mod_name)
        if mod is None or depth > 20:
            return qual
        if name in mod.bindings:
            return self.resolve(mod.bindings[name], depth + 1)
        if name in mod.aliases and name not in mod.classes:
            return self.resolve(self.qualify(mod, mod.aliases[name]), depth + 1)
        if mod_name in LAZY and name not in mod.classes:
            return self.resolve(f"{LAZY[mod_name]}.{name}", depth + 1)
        return qual

    def bases(self, qual: str) -> list[str]:
        mod_name, _, name = qual.rpartition(".")
        mod = self.mods.get(mod_name)
        if mod is None or name not in mod.classes:
            return []
        return [self.resolve(self.qualify(mod, b)) for b in mod.classes[name]]

    def is_class(self, qual: str) -> bool:
        mod_name, _, name = qual.rpartition(".")
        return mod_name in self.mods and name in self.mods[mod_name].classes

    def ancestors(self, qual: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for b in self.bases(qual):
            if b not in seen:
                out |= {b} | self.ancestors(b, seen | {qual})
        return out

    def is_exception(self, qual: str) -> bool:
        if not self.is_class(qual):
            return False
        for a in {qual} | self.ancestors(qual):
            mod_name, _, name = a.rpartition(".")
            if mod_name == "builtins" and issubclass(getattr(builtins, name, object), BaseException):
                return True
            if mod_name.split(".")[0] not in PACKAGES and name.endswith(FOREIGN_EXC_SUFFIXES):
                return True
        return False


@pytest.fixture(scope="module")
def index() -> Index:
    return Index(_load())


def _uses(mod: Module):
    """(line, the module a name is taken from, the name) of every `from X import N` and
    every `alias.N` where alias names a module."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(mod, node)
            for a in node.names:
                yield node.lineno, src, a.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node.value)
            if dotted is not None and dotted.split(".")[0] in mod.bindings:
                yield node.lineno, None, (dotted, node.attr)


def violations(index: Index) -> list[str]:
    out = []
    for mod in index.mods.values():
        for line, src, name in _uses(mod):
            if src is None:  # alias.N: only when alias is a module of the repository
                owner = index.qualify(mod, name[0])
                if owner not in index.mods or owner in LAZY:  # easerve.OverloadedError: the SDK's surface
                    continue
                src, name = owner, name[1]
            taken = f"{src}.{name}"
            real = index.resolve(taken)
            if real != taken and index.is_exception(real):
                out.append(f"{mod.path.relative_to(ROOT)}:{line}: takes {name} from {src}; "
                           f"import {real.rpartition('.')[2]} from {real.rpartition('.')[0]}")
        if mod.name.split(".")[0] == "tests" or mod.name == DOMAIN_HOME:
            continue
        for cls in mod.classes:
            qual = f"{mod.name}.{cls}"
            if DOMAIN_BASE in index.ancestors(qual):
                out.append(f"{mod.path.relative_to(ROOT)}: the domain error {cls} is defined outside "
                           f"{DOMAIN_HOME}; move it there")
    return sorted(out)


def test_errors_are_imported_only_from_where_they_are_defined(index):
    assert violations(index) == []


def test_the_walk_sees_re_exports_aliases_and_domain_errors_defined_elsewhere(index, tmp_path):
    """The checker itself: each way of taking an error from a second home is reported."""
    sources = {
        "easerve/rpc/errors.py": "from easerve.errors import NotFound\n",
        "easerve/client.py": "from easerve import errors as _e\nOverloadedError = _e.Overloaded\n",
        "easerve/a.py": "from easerve.rpc.errors import NotFound\n",
        "easerve/b.py": "from easerve.rpc import errors\nerrors.NotFound('x')\n",
        "easerve/c.py": "from easerve.client import OverloadedError\nfrom easerve import OverloadedError\n",
        "easerve/d.py": "from easerve.errors import NotFound\nclass Gone(NotFound):\n    pass\n",
        "easerve/ok.py": "from easerve.errors import NotFound\nfrom easerve import errors\nerrors.Overloaded\n",
    }
    mods = dict(index.mods)
    for rel, text in sources.items():
        m = _parse(ROOT / rel, text)
        mods[m.name] = m
    fake = Index(mods)
    found = [v for v in violations(fake) if v.split(":")[0] in sources]
    assert [v.split(":")[0] for v in found] == ["easerve/a.py", "easerve/b.py", "easerve/c.py", "easerve/c.py",
                                                "easerve/d.py"], found
    assert "import NotFound from easerve.errors" in found[0] and "import Overloaded from easerve.errors" in found[2]
    assert "takes OverloadedError from easerve;" in found[3]

