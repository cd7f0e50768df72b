"""Where runs keep things on disk: step_N checkpoints (atomic), best/ and the final model directory.

A checkpoint is written under a temporary name and renamed into place, so a directory named
step_N is always complete; `latest` is the newest such directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from nmt.errors import NmtError

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "nmt_checkpoint.json"  # written last inside a checkpoint, before the rename


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete step_N checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = STEP_DIR.match(d.name)
        if m and d.is_dir():
            if (d / COMPLETE).is_file():
                found.append((int(m.group(1)), d))
            else:
                log.warning("ignoring %s: it is incomplete (a run was killed while writing it)", d)
    return [d for _, d in sorted(found)]


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """`latest` -> the newest complete checkpoint of the run; a path -> that checkpoint, checked."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise NmtError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; "
                           "train without --resume to start fresh")
        return found[-1]
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise NmtError(f"--resume {resume}: not a complete nmt checkpoint (no {COMPLETE}); "
                       f"use --resume latest or a step_N folder from {checkpoints_dir(output_dir)}")
    return path


def read_info(path: Path) -> dict:
    """The JSON nmt wrote into a checkpoint (step, process count, loop and sampler state)."""
    try:
        return json.loads((path / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NmtError(f"{path / COMPLETE}: unreadable ({e}); resume from another checkpoint") from None


def temp_dir_for(final: Path) -> Path:
    return final.parent / f".tmp-{final.name}"


def mark_complete(tmp: Path, info: dict) -> None:
    (tmp / COMPLETE).write_text(json.dumps(info))


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place, replacing an older one atomically enough:
    the old directory is moved aside first and removed only after the new one is in place."""
    old = final.parent / f".old-{final.name}"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def prune(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (never the newest one)."""
    found = list_checkpoints(output_dir)
    for d in found[: max(len(found) - max(keep_last, 1), 0)]:
        shutil.rmtree(d, ignore_errors=True)
