"""What values a config key or flag allows: an interval for every numeric key, a kind for every path key.

A dataclass field declares them in its metadata (`ranged`, `path_key`), and `check_fields` checks an
instance in one place, naming the key, the value and what is allowed. The same call expands `~` and
environment variables in its path keys (`expand_paths`): every config, from YAML, flags or Python, holds the
paths it names, and no later reader expands them again. No torch and no filesystem here: path keys are checked
against the disk by `nmt.validate` at the start of training and `nmt check`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nmt.errors import NmtError

RANGE, PATH = "range", "path"  # the metadata keys
# what each path kind must be on disk: the README table's "allowed" column and nmt.validate's messages
PATH_KINDS = {
    "folder": "a folder path (created if missing)",
    "corpus": "a corpus: PREFIX of .<lang> files, a .tsv/.jsonl/.csv file, a save_to_disk folder, hub: or builtin:",
    "checkpoint": "latest, auto, or a checkpoint folder output_dir/checkpoints/step_N",
    "model": "a model directory (output_dir/model or output_dir/best) with config.json, weights and tokenizer",
}


@dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval written as in mathematics: "[0, 1)", "(0, 10]", "[1, 1e9]".

    Both ends are finite, so an absurd value (a typo's extra zeros, inf, nan) is always refused.
    """

    text: str
    lo: float = field(init=False, compare=False)
    hi: float = field(init=False, compare=False)
    lo_open: bool = field(init=False, compare=False)
    hi_open: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        m = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])", self.text)
        if not m:
            raise ValueError(f"not an interval: {self.text!r}")
        lo, hi = float(m[2]), float(m[3])
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"an interval needs finite ends, low <= high: {self.text!r}")
        for name, value in (("lo", lo), ("hi", hi), ("lo_open", m[1] == "("), ("hi_open", m[4] == ")")):
            object.__setattr__(self, name, value)

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and math.isnan(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        return self.text


def ranged(default: Any, allowed: str) -> Any:
    """A numeric dataclass field whose values (each element of a list or tuple; None passes) lie in `allowed`."""
    return field(default=default, metadata={RANGE: Range(allowed)})


def path_key(default: Any, kind: str) -> Any:
    """A dataclass field naming a path of `kind` (a key of PATH_KINDS), checked by nmt.validate.check_paths."""
    if kind not in PATH_KINDS:
        raise ValueError(f"unknown path kind {kind!r}")
    return field(default=default, metadata={PATH: kind})


def allowed_text(f: dataclasses.Field) -> str:
    """What a field allows, in a few words: its interval or its path kind (empty when neither)."""
    if RANGE in f.metadata:
        return str(f.metadata[RANGE])
    return f.metadata.get(PATH, "")


def check_fields(obj: Any, prefix: str = "", noun: str = "config key") -> None:
    """Refuse the first field of dataclass `obj` whose value lies outside its declared range, after expanding its
    path keys (`expand_paths`).

    The message names the key (`prefix` + field name), the value and the allowed interval.
    """
    expand_paths(obj, prefix, noun)
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get(RANGE)
        value = getattr(obj, f.name)
        if allowed is None or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item not in allowed:
                raise NmtError(f"{noun} '{prefix}{f.name}': {value!r} is outside the allowed range {allowed}")


def expand_paths(obj: Any, prefix: str = "", noun: str = "config key") -> None:
    """Replace `~` and `$VAR` / `${VAR}` in the path keys of dataclass `obj` (each item of a list) by what they
    stand for. Idempotent: a path without them is left as it is. A variable that is not set is an error naming
    the key, rather than a folder named `$VAR` made later."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if PATH not in f.metadata or value is None:
            continue
        key = f"{noun} '{prefix}{f.name}'"
        expanded = [expand_path(v, key) for v in value] if isinstance(value, list) else expand_path(value, key)
        if expanded != value:
            setattr(obj, f.name, expanded)


def expand_path(text: Any, key: str) -> Any:
    """`text` with `~` and environment variables expanded (a non-string is returned as it is, for the type check)."""
    if not isinstance(text, str):
        return text
    out = os.path.expanduser(os.path.expandvars(text))
    unset = [m[1] or m[2] for m in re.finditer(r"\$(?:(\w+)|\{([^}]*)\})", out) if (m[1] or m[2]) not in os.environ]
    if unset:
        raise NmtError(f"{key}: {text!r} names the environment variable ${unset[0]}, which is not set; set it or "
                       "write the path out")
    return out


def walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) for every leaf field of a tree of dataclass instances."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value
