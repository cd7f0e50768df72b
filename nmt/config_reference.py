"""The configuration reference, from the config dataclasses' field comments: the table of
docs/configuration.md (`reference_markdown`) and `nmt train --help` (`reference_text`).

    python -m nmt.config_reference docs/configuration.md    # rewrite the page's table from nmt/config.py
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from nmt.config import TrainConfig
from nmt.ranges import allowed_text


def config_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, Any, str, str]]:
    """(dotted key, type, default, comment, allowed) for every field: the configuration reference.
    `allowed` is a numeric key's interval or a path key's kind (nmt.ranges), else empty."""
    import inspect

    comments = _field_comments(inspect.getsource(cls))
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            rows += config_fields(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, _type_name(hints[f.name]), default, comments.get(f.name, ""), allowed_text(f)))
    return rows


def _field_comments(source: str) -> dict[str, str]:
    out = {}
    for line in source.splitlines():
        name, colon, rest = line.strip().partition(":")
        if colon and name.isidentifier() and "#" in rest:
            out[name] = rest.split("#", 1)[1].strip()
    return out


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def reference_markdown() -> str:
    """The table of docs/configuration.md, generated from the field comments of nmt.config."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, tp, default, doc, allowed in config_fields():
        shown = "null" if default is None else json_default(default)
        allowed = f"`{allowed}`" if allowed[:1] in "[(" and allowed else allowed
        lines.append(f"| `{key}` | {tp.replace('|', 'or')} | `{shown}` | {allowed} | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def reference_text() -> str:
    """The same reference as `reference_markdown`, for a terminal (`nmt train --help`): keys grouped by section,
    each with its type, default and allowed values, then its meaning on the next line."""
    groups: dict[str, list[str]] = {}
    for key, tp, default, doc, allowed in config_fields():
        section = key.split(".")[0] if "." in key else "training"
        shown = "null" if default is None else json_default(default)
        groups.setdefault(section, []).append(f"  --{key} {tp} = {shown}{f'  (allowed: {allowed})' if allowed else ''}\n"
                                              f"        {doc}")
    out = ["config keys: override any as --KEY VALUE or KEY=VALUE; docs/configuration.md has the same table"]
    for section, lines in groups.items():
        out += ["", f"{section}:", *lines]
    return "\n".join(out) + "\n"


def json_default(value: Any) -> str:
    import json

    return json.dumps(list(value) if isinstance(value, tuple) else value)


START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def table_in(page: str) -> str:
    """The generated table as a page holds it, between its START and END markers."""
    return page[page.index(START) + len(START): page.index(END)]


def main(argv: list[str] | None = None) -> None:
    """Rewrite the table between the markers of the page named on the command line (atomically)."""
    import os
    import sys
    from pathlib import Path

    path = Path((argv if argv is not None else sys.argv[1:])[0])
    page = path.read_text(encoding="utf-8")
    new = page.replace(START + table_in(page) + END, START + reference_markdown() + END)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
