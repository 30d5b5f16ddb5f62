"""A stage config's command line, generated from its fields (easerve.stages.common.configs).

`parser(cls)` builds the argparse parser, `from_argv(cls, argv)` the config (a ValueError says
what to change), `to_argv(cfg)` the command line that parses back into it, and
`tunable_flags(stage)` lists the flags a deployment file may set (the rest, marked `wired`,
are peer addresses and ports that the launcher sets itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

from easerve.fields import choices, flag_name, hints, is_flag
from easerve.stages.common.configs import STAGE_CONFIGS, StageConfig


# ---- command lines ---------------------------------------------------------------------------
def _flags(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if is_flag(f)]


def _kind(cls, f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    if choices(hint):
        return type(choices(hint)[0])
    return tuple if hint is tuple or typing.get_origin(hint) is tuple else hint


def parser(cls: type[StageConfig], stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.{stage}", description=f"EAServe {stage} stage")
    for f in _flags(cls):
        kind, flag = _kind(cls, f), f"--{flag_name(f.name)}"
        default = _default(f)
        helptext = f.metadata.get("help", "")
        if f.metadata.get("repeat"):
            p.add_argument(flag, type=_split, action="append", default=None, help=helptext)
        elif kind is bool:
            p.add_argument(flag, action="store_true", default=default, help=helptext)
        elif kind is tuple:
            p.add_argument(flag, type=_split, default=default, help=helptext)
        else:
            p.add_argument(flag, type=kind, default=default, help=helptext, choices=choices(hints(cls)[f.name]))
    return p


def _default(f: dataclasses.Field) -> Any:
    """A flag's default: the field's, or for --log-level / --api-key the environment's."""
    if f.name == "log_level":
        return os.environ.get("EASERVE_LOG_LEVEL", f.default)
    if f.name == "api_key":
        return _split(os.environ.get("EASERVE_API_KEY", ""))
    return f.default


def _split(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def from_argv(cls: type[StageConfig], stage: str, argv: list[str]):
    """Parse a stage's command line into its config; a bad value exits with the message."""
    p = parser(cls, stage)
    kw = vars(p.parse_args(argv))
    for f in _flags(cls):
        if f.metadata.get("repeat"):  # None: not given (the parser's default); else a list of tuples
            given = kw[f.name]
            kw[f.name] = _default(f) if given is None else tuple(a for part in given for a in part)
    try:
        return cls(**kw)
    except ValueError as e:
        p.error(str(e))


def tunable_flags(stage: str) -> tuple[str, ...]:
    """Flags (dashed) a deployment file may set for `stage`."""
    return tuple(flag_name(f.name) for f in _flags(STAGE_CONFIGS[stage]) if not f.metadata.get("wired"))


def flag_kind(stage: str, flag: str) -> type:
    cls = STAGE_CONFIGS[stage]
    f = {flag_name(x.name): x for x in _flags(cls)}[flag]
    return _kind(cls, f)


def to_argv(cfg: StageConfig) -> list[str]:
    """The command line that parses back into `cfg`: the wired fields (model, device,
    addresses) always, the others where they differ from their default."""
    out: list[str] = []
    for f in _flags(cfg):
        v = getattr(cfg, f.name)
        if v in ("", ()) or (v == f.default and not f.metadata.get("wired")):
            continue
        flag = f"--{flag_name(f.name)}"
        if isinstance(v, bool):
            out += [flag] if v else []
        elif f.metadata.get("repeat"):
            out += [x for a in v for x in (flag, a)]
        elif isinstance(v, tuple):
            out += [flag, ",".join(v)]
        else:
            out += [flag, str(v)]
    return out
