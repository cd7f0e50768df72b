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


def resume_candidates(resume: str | None, output_dir: str | Path) -> list[Path]:
    """The checkpoints `resume` may start from, newest first: `latest` -> the run's complete checkpoints (at least
    one), `auto` -> the same, possibly none (a fresh start), None -> none, a path -> that checkpoint, checked."""
    if resume is None:
        return []
    if resume in ("latest", "auto"):
        found = list_checkpoints(output_dir)[::-1]
        if not found and resume == "latest":
            raise NmtError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; "
                           "train without --resume to start fresh, or use --resume auto")
        return found
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise NmtError(f"--resume {resume}: not a complete nmt checkpoint (no {COMPLETE}); "
                       f"use --resume latest or a step_N folder from {checkpoints_dir(output_dir)}")
    return [path]


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """`latest` -> the newest complete checkpoint of the run; a path -> that checkpoint, checked."""
    return resume_candidates(resume, output_dir)[0]


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


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, and the folders themselves, to disk: a rename is atomic, but without
    this a crash soon after it can leave a complete-looking step_N whose files are empty or cut short."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place, replacing an older one atomically enough:
    the old directory is moved aside first and removed only after the new one is in place."""
    old = final.parent / f".old-{final.name}"
    if old.exists():
        shutil.rmtree(old)
    fsync_tree(tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def prune(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (never the newest one)."""
    found = list_checkpoints(output_dir)
    for d in found[: max(len(found) - max(keep_last, 1), 0)]:
        shutil.rmtree(d, ignore_errors=True)
