"""Small helpers every subcommand handler shares: extra arguments, the main process, reading line files."""

from __future__ import annotations

import os

from nmt.errors import NmtError
from nmt.validate import utf8_lines


def no_extra(extra: list[str]) -> None:
    if extra:
        raise NmtError(f"unexpected arguments: {' '.join(extra)}")


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def read_lines(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [line.rstrip("\r\n") for line in utf8_lines(f, path)]  # names the first line that is not UTF-8
    except FileNotFoundError:
        raise NmtError(f"file not found: {path}") from None


def numbers(lines: list[int]) -> str:
    """Line numbers for a message: the first 20, then "..."."""
    return ", ".join(map(str, lines[:20])) + (", ..." if len(lines) > 20 else "")
