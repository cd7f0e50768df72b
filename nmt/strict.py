"""Dataclasses from plain data and back, strictly: unknown keys and wrong types raise `NmtError` naming the key
(`from_dict`); `to_dict` gives the plain nested dict for YAML and JSON. Knows no config class."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal

from nmt.errors import NmtError


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys and wrong types by name. A class with a static
    `renamed_keys(data, where) -> data` maps its older key names first."""
    if not isinstance(data, dict):
        raise NmtError(f"config key {where or '<root>'!r}: expected a mapping, got {type(data).__name__}")
    data = dict(data)
    if hasattr(cls, "renamed_keys"):  # a class's older key names (ModelConfig: preset)
        data = cls.renamed_keys(data, where)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise NmtError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        for member in members[:-1]:  # str | list[str]: the first that takes the value
            try:
                return _coerce(member, value, path)
            except NmtError:
                continue
        return _coerce(members[-1], value, path)
    if origin is Literal:
        if value not in args:
            raise NmtError(f"config key {path!r}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise NmtError(f"config key {path!r}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
        if origin is tuple and len(args) > 1 and args[1] is not Ellipsis and len(items) != len(args):
            raise NmtError(f"config key {path!r}: expected {len(args)} values, got {len(items)}")
        return tuple(items) if origin is tuple else items
    return _scalar(tp, value, path)


EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value) if abs(value) < 2**1023 else math.inf if value > 0 else -math.inf  # refused by its range
    if tp is float and isinstance(value, str) and EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)  # 1e-3: YAML 1.1 (PyYAML) reads a float without a dot as a string
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise NmtError(f"config key {path!r}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (lists for tuples) suitable for YAML/JSON."""
    return _plain(cfg)


def flat(d: dict, prefix: str = "") -> dict:
    """A nested dict as one level of dotted keys: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(getattr(value, "name", value))  # an object given from Python (a tracker in log_with): its name

