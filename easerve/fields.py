"""Config fields declared once: a frozen dataclass field's type states its bounds, and
`check_fields` enforces them with an error that names what to change.

A bound is part of the annotation, `Annotated[int, Field(ge=1)]` (pydantic's `Field`), a
choice is a `Literal`, and a format a validator (`Annotated[str, AfterValidator(...)]`).
`check_fields(obj)` validates each field's value against its annotation (strict: no value
is converted) and raises `FieldError`, whose text names the flag (`--max-running`) of a field
declared with `opt`, else the field's own name. Stage configs (easerve.stages.common.configs)
turn the `opt` fields into flags; the policies' and the engine's configs use the same check.
The device a stage runs on (`Device`: 'cpu', 'cpu:0-3', 'cuda:N') is read here too: what torch
calls it (`torch_device`) and the cores it names (`cpu_cores`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Share = Annotated[float, Field(gt=0, le=1)]           # a fraction in (0, 1]
Fraction = Annotated[float, Field(ge=0, le=1)]        # a fraction in [0, 1]


def opt(default: Any = dataclasses.MISSING, help: str = "", *, wired: bool = False, repeat: bool = False,
        secret: bool = False, note: str = ""):
    """A field that is a flag `--field-name`, with its help; `wired`: set by the launcher, not by a
    deployment; `repeat`: a tuple flag that may also be given several times; `secret`: kept out
    of repr; `note`: said after a bound the value breaks (e.g. "0 = automatic")."""
    return dataclasses.field(default=default, repr=not secret,
                             metadata={"help": help, "wired": wired, "repeat": repeat, "note": note})


def is_flag(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def flag_name(name: str) -> str:
    return name.replace("_", "-")


class FieldError(ValueError):
    """A field's value breaks its declared type or bound; `name` is the flag or field to change."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name} {problem}" if problem.startswith(("must", "(")) else f"{name}: {problem}")
        self.name, self.problem = name, problem


@contextlib.contextmanager
def flags_for(**flags: str):
    """Inside: a FieldError of a config built from flags names the flag (`flags`: field -> flag)."""
    try:
        yield
    except FieldError as e:
        if e.name not in flags:
            raise
        raise FieldError(flags[e.name], e.problem) from None


def choices(hint: Any) -> tuple | None:
    """The values a `Literal` (or `Annotated[Literal, ...]`) annotation allows; None for others."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


_HINTS: dict[type, dict[str, Any]] = {}
_ADAPTERS: dict[tuple[type, str], TypeAdapter] = {}


def hints(cls: type) -> dict[str, Any]:
    """The field annotations of a dataclass, with their Annotated bounds."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return _HINTS[cls]


def check_fields(obj: Any) -> None:
    """Raise FieldError for the first field of `obj` whose value breaks its annotation."""
    cls = type(obj)
    for f in dataclasses.fields(obj):
        key = (cls, f.name)
        if key not in _ADAPTERS:
            _ADAPTERS[key] = TypeAdapter(hints(cls)[f.name])
        value = getattr(obj, f.name)
        try:
            _ADAPTERS[key].validate_python(value, strict=True)
        except ValidationError as e:
            name = f"--{flag_name(f.name)}" if is_flag(f) else f.name
            raise FieldError(name, _problem(e.errors()[0], hints(cls)[f.name], value, f.metadata.get("note"))) \
                from None


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_KINDS = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
          "bool_type": "true or false", "tuple_type": "a tuple", "finite_number": "a finite number"}


class Checked:
    """Base of a frozen dataclass whose fields are checked against their declared bounds on
    construction (`check_fields`)."""

    def __post_init__(self) -> None:
        check_fields(self)


def _problem(err: dict, hint: Any, value: Any, note: str | None) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "value_error":  # a validator's ValueError says what is wrong
        return f"{ctx['error']}"
    if kind in _BOUNDS:
        b = _bounds(hint)
        if len(b) == 2:  # a range: say both ends
            text = f"must be in {'[' if 'ge' in b else '('}{b.get('ge', b.get('gt')):g}, " \
                   f"{b.get('le', b.get('lt')):g}{']' if 'le' in b else ')'}"
        else:
            key = {">=": "ge", ">": "gt", "<=": "le", "<": "lt"}[_BOUNDS[kind]]
            text = f"must be {_BOUNDS[kind]} {ctx[key]:g}"
        text += f" ({note})" if note else ""
    elif kind == "literal_error":
        text = f"must be one of {', '.join(map(str, choices(hint)))}"
    else:
        text = f"must be {_KINDS.get(kind, err['msg'].replace('Input should be ', ''))}"
    return f"{text}, got {value!r}"


def _bounds(hint: Any) -> dict[str, float]:
    """{"ge": 0, "le": 1, ...}: the bounds an Annotated hint declares."""
    out: dict[str, float] = {}
    for m in typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ():
        for item in getattr(m, "metadata", [m]):
            out.update({k: getattr(item, k) for k in ("ge", "gt", "le", "lt") if getattr(item, k, None) is not None})
    return out


# ---- formats ----------------------------------------------------------------------------
def _host_port(a: str) -> str:
    host, _, port = a.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"must be host:port, got {a!r}")
    return a


def _addresses(value: tuple[str, ...]) -> tuple[str, ...]:
    for a in value:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {a!r} must be host:port")
    return value


_DEVICE = re.compile(r"^(cpu(:\d+(-\d+)?(,\d+(-\d+)?)*)?|cuda(:\d+)?)$")
_DEVICE_FORMS = "'cpu', 'cpu:0-3' (those cores), 'cuda' or 'cuda:N'"


def _device(device: str) -> str:
    if not _DEVICE.match(device):
        raise ValueError(f"must be {_DEVICE_FORMS}, got {device!r}")
    return device


HostPort = Annotated[str, AfterValidator(_host_port)]
Addresses = Annotated[tuple[str, ...], AfterValidator(_addresses)]
Device = Annotated[str, AfterValidator(_device)]


def check_device(device: str) -> None:
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"device must be {_DEVICE_FORMS}, got {device!r}")


def torch_device(device: str) -> str:
    """What torch calls the device: 'cpu:0-1' is 'cpu'."""
    return "cpu" if device.startswith("cpu") else device


def cpu_cores(device: str) -> tuple[int, ...] | None:
    """The cores of a 'cpu:0-1,4' device, or None for plain 'cpu' / a GPU."""
    if not device.startswith("cpu:"):
        return None
    cores: list[int] = []
    for part in device[4:].split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return tuple(sorted(set(cores)))
