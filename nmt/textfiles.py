"""Reading text lines, plain-text corpora straight to Arrow, and files written all or nothing, never over their own
inputs.

Every text input (training files, TSV, JSONL, CSV, `nmt translate --input` and stdin, `nmt evaluate`, `nmt score`,
back-translation) is read as UTF-8 by the functions here, with one rule for a byte order mark: it is dropped from
the start of line 1 (`without_bom`), where editors put it, and kept anywhere else, where it is text. A line that
is not UTF-8 is an error naming it.

No `datasets` here: each corpus reader writes an Arrow IPC stream (columns "src", "tgt") that nmt.data opens
memory-mapped. Lines are decoded a chunk at a time (one `bytes.decode` per chunk, not per line); only a
chunk that fails to decode is re-read line by line to name the line.

Writing (`atomic_path`, `atomic_file`) goes to a temporary file in the target's folder, renamed onto the target
when complete: a failed or killed command leaves the old file as it was. `refuse_overwrite` keeps a command from
writing over one of its own inputs (the same file under another name, through a symlink or a hard link).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from nmt.errors import NmtError

SCHEMA = pa.schema([("src", pa.string()), ("tgt", pa.string())])
CHUNK_LINES = 100_000


BOM = "\ufeff"  # U+FEFF: a byte order mark at the start of a file, a zero-width no-break space anywhere else


def without_bom(text: str, line_no: int) -> str:
    """`text`, line `line_no` (from 1) of an input or a run of lines starting there, without a BOM at the start of
    line 1: the one rule for every text input."""
    return text.removeprefix(BOM) if line_no == 1 else text


def decode_line(raw: bytes, path: str | Path, line_no: int, keep_end: bool = False) -> str:
    """Line `line_no` of `path` as text, without a BOM on line 1 and (unless `keep_end`) its line ending; names the
    line if it is not UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NmtError(f"{path}:{line_no}: not valid UTF-8 (byte {e.start + 1} of the line); "
                       "convert it, e.g. iconv -f latin1 -t utf-8") from None
    text = without_bom(text, line_no)
    return text if keep_end else text.rstrip("\r\n")


def utf8_lines(stream: Iterable[bytes | str], name: str | Path, keep_ends: bool = True) -> Iterator[str]:
    """The lines of a binary stream (a file opened "rb", stdin's buffer; or text already decoded) as str, line ends
    kept unless `keep_ends` is false, the BOM dropped from line 1, the first line that is not UTF-8 refused by its
    number (`name`:N)."""
    for n, raw in enumerate(stream, 1):
        if isinstance(raw, str):
            text = without_bom(raw, n)
            yield text if keep_ends else text.rstrip("\r\n")
        else:
            yield decode_line(raw, name, n, keep_end=keep_ends)


def decode_lines(lines: list[bytes], path: Path, first_line: int) -> pa.Array:
    """(n,) string array of `lines` (raw lines of `path` starting at line `first_line`), endings stripped."""
    try:
        text = b"".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        for i, raw in enumerate(lines, first_line):
            decode_line(raw, path, i)  # raises, naming the line
        raise
    text = without_bom(text, first_line)
    rows = text.split("\n")
    if text.endswith("\n"):
        rows.pop()
    return pc.utf8_rtrim(pa.array(rows, pa.string()), characters="\r")


def count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def text_pair_batches(src: Path, tgt: Path, chunk_lines: int = CHUNK_LINES) -> Iterator[pa.RecordBatch]:
    """Line i of `src` with line i of `tgt`, `chunk_lines` pairs per batch."""
    with open(src, "rb") as fs, open(tgt, "rb") as ft:
        line = 1
        while True:
            a, b = list(islice(fs, chunk_lines)), list(islice(ft, chunk_lines))
            if len(a) != len(b):
                n_src, n_tgt = count_lines(src), count_lines(tgt)
                raise NmtError(f"{src} has {n_src} lines but {tgt} has {n_tgt}; "
                               "line i of one must be the translation of line i of the other")
            if not a:
                return
            yield pa.record_batch([decode_lines(a, src, line), decode_lines(b, tgt, line)], schema=SCHEMA)
            line += len(a)


def tsv_batches(path: Path, chunk_lines: int = CHUNK_LINES) -> Iterator[pa.RecordBatch]:
    """Column 1 is the source, column 2 the target; further columns (attribution) are ignored."""
    with open(path, "rb") as f:
        line = 1
        while lines := list(islice(f, chunk_lines)):
            cols = pc.split_pattern(decode_lines(lines, path, line), "\t", max_splits=2)
            n_cols = pc.list_value_length(cols).to_numpy()
            if (short := (n_cols < 2).nonzero()[0]).size:
                raise NmtError(f"{path}:{line + int(short[0])}: expected source<TAB>target, found 1 column; "
                               "fix or remove the line")
            yield pa.record_batch([pc.list_element(cols, 0), pc.list_element(cols, 1)], schema=SCHEMA)
            line += len(lines)


def write_arrow(batches: Iterator[pa.RecordBatch], out: Path, schema: pa.Schema = SCHEMA) -> int:
    """Write `batches` as an Arrow IPC stream at `out` (atomically: a temporary name, then a rename); rows written.

    Two processes filling the same cache write their own temporary files; the last rename wins (same content).
    """
    rows = 0
    with atomic_path(out) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
            rows += batch.num_rows
    return rows


# --- writing without destroying ------------------------------------------------------------------


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path in `path`'s folder for the block to write; renamed onto `path` when the block ends without
    an error, removed when it fails (`path` stays as it was). A symlink is written through (its target is
    replaced, the link stays); an existing file keeps its permissions. The temporary name ends like `path`, so a
    writer that picks the format by the suffix (matplotlib) still does."""
    path = Path(path)
    _not_a_folder(path)
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise NmtError(f"{path}: cannot write it, the folder {target.parent} does not exist")
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")  # per process: two writers never share one
    try:
        yield tmp
        if target.is_file():
            shutil.copymode(target, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):
    """`open(path, mode)` written all or nothing (`atomic_path`). What is not a regular file (a FIFO,
    /dev/stdout) is opened and written as it is: it cannot be replaced, and has nothing to lose."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        with open(path, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        return
    with atomic_path(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
        yield f


def refuse_overwrite(outputs: Iterable[tuple[str, str | Path | None]],
                     inputs: Iterable[tuple[str, str | Path | int | None]]) -> None:
    """NmtError when an output file is a folder or names one of the inputs: the same file, also through a symlink or
    a hard link. Each is (what the user calls it, e.g. "--output", path); an input may be an open file descriptor
    (stdin) and a folder (a model directory) stands for every file in it. Outputs that do not exist are new files."""
    inputs = list(_input_files(inputs))
    for out_name, out in outputs:
        if out is None or not os.path.exists(out):
            continue
        _not_a_folder(Path(out), out_name)
        out_stat = os.stat(out)
        for in_name, path, in_stat in inputs:
            if os.path.samestat(out_stat, in_stat):
                raise NmtError(f"{out_name} {out} is {f'{in_name} {path}'.strip()}: writing it would destroy the "
                               "input; choose another output path")


def _not_a_folder(path: Path, name: str = "") -> None:
    if path.is_dir():
        raise NmtError(f"{f'{name} {path}'.strip()}: is a folder; give the path of a file to write")


def _input_files(inputs: Iterable[tuple[str, str | Path | int | None]]) -> Iterator[tuple[str, str, os.stat_result]]:
    for name, item in inputs:
        if item is None:
            continue
        if isinstance(item, int):
            try:
                st = os.fstat(item)
            except OSError:
                continue
            yield name, "", st
        elif os.path.isdir(item):
            for entry in sorted(Path(item).iterdir()):
                if entry.is_file():
                    yield f"{entry.name} of {name}", str(item), entry.stat()
        elif os.path.exists(item):
            yield name, str(item), os.stat(item)


class ResumableOutput:
    """A line file written in commits that a killed run continues: `nmt translate --input F --output O`.

    The lines go to a partial file beside `path` (.O.nmt-partial); each `commit(lines)` makes them durable (fsync)
    and then records, atomically, how many input lines they answer and how many bytes they take
    (.O.nmt-resume.json, with `fingerprint`: the input's and the settings'). `start()` reads that record: the same
    fingerprint continues after the recorded lines (the partial file cut back to the recorded bytes, so a kill
    between a write and its commit loses only that commit's lines); another fingerprint, or no record, starts
    over. `finish()` renames the partial file onto `path` and removes the record: `path` only ever holds a whole
    output, byte for byte what an uninterrupted run writes."""

    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path)
        _not_a_folder(self.path)
        target = Path(os.path.realpath(self.path))
        if not target.parent.is_dir():
            raise NmtError(f"{path}: cannot write it, the folder {target.parent} does not exist")
        self.partial = target.with_name(f".{target.name}.nmt-partial")
        self.record = target.with_name(f".{target.name}.nmt-resume.json")
        self.target, self.fingerprint = target, fingerprint
        self.file = None
        self.bytes = 0

    def start(self) -> tuple[int, str | None]:
        """(input lines already answered, what to tell the user about it, or None for a fresh start)."""
        import json

        done, said = 0, None
        if self.record.is_file():
            try:
                record = json.loads(self.record.read_text(encoding="utf-8"))
                same = record.get("fingerprint") == self.fingerprint
                lines, size = int(record["lines"]), int(record["bytes"])
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                same, lines, size = False, 0, 0
            if same and self.partial.is_file() and self.partial.stat().st_size >= size:
                done, self.bytes = lines, size
                said = f"continuing {self.path} after line {lines:,} (what an earlier run of this command wrote)"
            else:
                said = (f"starting {self.path} over: the input, the model or the settings changed since the run "
                        "that left its partial output")
        self.file = open(self.partial, "r+b" if done else "wb")
        self.file.truncate(self.bytes)
        self.file.seek(self.bytes)
        return done, said

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        self.file.write(data)
        self.bytes += len(data)

    def commit(self, lines: int) -> None:
        """What is written so far answers the first `lines` input lines: make it survive a kill."""
        import json

        self.file.flush()
        os.fsync(self.file.fileno())
        with atomic_file(self.record) as f:
            json.dump({"fingerprint": self.fingerprint, "lines": lines, "bytes": self.bytes}, f)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.target.is_file():
            shutil.copymode(self.target, self.partial)
        os.replace(self.partial, self.target)
        self.record.unlink(missing_ok=True)

    def close(self) -> None:
        """Leaves the partial output and its record for the next run (an error, a kill: nothing else to do)."""
        if self.file is not None and not self.file.closed:
            self.file.close()


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, read a megabyte at a time."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
