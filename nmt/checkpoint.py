"""Where runs keep things on disk: step_N checkpoints (atomic), best/ and the final model directory, and what
each was made with.

A checkpoint is written under a temporary name and renamed into place, so a directory named
step_N is always complete; `latest` is the newest such directory. Checkpoints and model directories record
the sha256 fingerprints of the data they were trained on and of their tokenizer file(s) (`FINGERPRINTS`), so a
resume on other data and a model directory with another tokenizer are named instead of silently misread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from nmt.errors import NmtError
from nmt.model_dir import JOINT_FILE, SRC_FILE, SUMMARY_FILE, TGT_FILE, read_json

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "nmt_checkpoint.json"  # written last inside a checkpoint, before the rename
TEMPORARY = (".tmp-", ".old-")  # name prefixes of folders being written or replaced (`temp_dir_for`, `publish`)
FINGERPRINTS = "fingerprints"  # key in COMPLETE and training.json: {"train", "valid", "test", "tokenizer"} -> sha256


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
    """A name of this process's own for `final` while it is written: two writers never share one."""
    return final.parent / f".tmp-{final.name}-{_unique()}"


def _unique() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_temporaries(output_dir: str | Path) -> None:
    """Delete the temporary folders a killed run left in `output_dir` and its checkpoints/ (call only while
    holding the folder's lock: then no other process is writing them)."""
    for root in (Path(output_dir), checkpoints_dir(output_dir)):
        for d in root.iterdir() if root.is_dir() else []:
            if d.name.startswith(TEMPORARY) and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


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
    old = final.parent / f".old-{final.name}-{_unique()}"
    fsync_tree(tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)



def write_directory(out: Path, write: Callable[[Path], None]) -> Path:
    """`write` fills a sibling temporary directory, which then replaces `out` whole: a failed or killed write leaves
    `out` as it was (a killed one's leftover is removed by the next write)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = temp_dir_for(out)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write(partial)
        publish(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def prune(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (never the newest one)."""
    found = list_checkpoints(output_dir)
    for d in found[: max(len(found) - max(keep_last, 1), 0)]:
        shutil.rmtree(d, ignore_errors=True)


# --- fingerprints: what a checkpoint or model directory was made with ---------------------------------------------


def sha256_parts(parts: Iterable[bytes]) -> str:
    """One sha256 over several byte strings, each prefixed by its length (no two splits of the bytes collide)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer file(s) in `directory`, as PairTokenizer.load picks them (empty: none there)."""
    directory = Path(directory)
    if (directory / JOINT_FILE).is_file():
        return [directory / JOINT_FILE]
    pair = [directory / SRC_FILE, directory / TGT_FILE]
    return pair if all(p.is_file() for p in pair) else []


def tokenizer_sha256(directory: str | Path) -> str | None:
    """The fingerprint of the tokenizer file(s) in `directory`, byte for byte; None when it holds none."""
    files = tokenizer_files(directory)
    return sha256_parts(p.read_bytes() for p in files) if files else None


def check_fingerprint(directory: str | Path) -> None:
    """A model directory's tokenizer must be the one its model was trained with: training.json records the sha256
    of the tokenizer file(s) as they were written, and another tokenizer (even one of the same size, whose ids
    mean other subwords) is refused. Directories without that record (not written by training) pass."""
    directory = Path(directory)
    try:
        recorded = (read_json(directory / SUMMARY_FILE).get(FINGERPRINTS) or {}).get("tokenizer")
    except (OSError, NmtError):
        return  # no training.json, or not one training wrote: nothing recorded to compare
    found = tokenizer_sha256(directory)
    if recorded and found and found != recorded:
        names = " + ".join(p.name for p in tokenizer_files(directory))
        raise NmtError(f"{directory}: {names} is not the tokenizer this model was trained with (its sha256 is "
                       f"{found[:12]}..., {SUMMARY_FILE} records {recorded[:12]}...), so its ids would mean other "
                       f"subwords; put back the model's own tokenizer file(s) (the run's best/ or model/ holds them)")


def data_changes(saved: dict, now: dict) -> list[str]:
    """The names in `now` (splits: "train", "valid", "test") whose fingerprint differs from `saved`'s; a name
    `saved` does not record (a checkpoint from before fingerprints) is not compared."""
    return [name for name, value in now.items() if saved.get(name) not in (None, value)]
