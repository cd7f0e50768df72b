"""Small helpers every subcommand handler shares: extra arguments, the main process, reading line files."""

from __future__ import annotations

import argparse
import os
import sys

from nmt.errors import NmtError
from nmt.validate import utf8_lines


def no_extra(extra: list[str]) -> None:
    if extra:
        raise NmtError(f"unexpected arguments: {' '.join(extra)}")


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def stdin_fd() -> int | None:
    """The descriptor of stdin, when it has one (a file redirected with < is an input an output must not name)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor (a notebook, a test)
        return None


def model_inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The model directories a command reads (MODEL_DIR, several for an ensemble; --ct2 DIR), for
    `nmt.textfiles.refuse_overwrite`: no output may name a file in them."""
    dirs = args.model_dir if isinstance(args.model_dir, list) else [args.model_dir]
    ct2 = getattr(args, "ct2", None)
    return [("MODEL_DIR", d) for d in dirs if d] + ([("--ct2", ct2)] if ct2 else [])


def read_lines(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [line.rstrip("\r\n") for line in utf8_lines(f, path)]  # names the first line that is not UTF-8
    except FileNotFoundError:
        raise NmtError(f"file not found: {path}") from None


def numbers(lines: list[int]) -> str:
    """Line numbers for a message: the first 20, then "..."."""
    return ", ".join(map(str, lines[:20])) + (", ..." if len(lines) > 20 else "")
