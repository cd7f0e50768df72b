"""Plain-text corpora straight to Arrow: aligned line files and TSV, read in chunks of lines.

No `datasets` here: each reader writes an Arrow IPC stream (columns "src", "tgt") that nmt.data opens
memory-mapped. Lines are decoded a chunk at a time (one `bytes.decode` per chunk, not per line); only a
chunk that fails to decode is re-read line by line to name the line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from nmt.compat import release_free_memory
from nmt.errors import NmtError

SCHEMA = pa.schema([("src", pa.string()), ("tgt", pa.string())])
CHUNK_LINES = 100_000
TRIM_ROWS = 100_000


def decode_line(raw: bytes, path: Path, line_no: int) -> str:
    """One line as text, without its line ending (and without a BOM on line 1); names the line if not UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NmtError(f"{path}:{line_no}: not valid UTF-8 (byte {e.start + 1} of the line); "
                       "convert the file, e.g. iconv -f latin1 -t utf-8") from None
    if line_no == 1:
        text = text.removeprefix("\ufeff")
    return text.rstrip("\r\n")


def decode_lines(lines: list[bytes], path: Path, first_line: int) -> pa.Array:
    """(n,) string array of `lines` (raw lines of `path` starting at line `first_line`), endings stripped."""
    try:
        text = b"".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        for i, raw in enumerate(lines, first_line):
            decode_line(raw, path, i)  # raises, naming the line
        raise
    if first_line == 1:
        text = text.removeprefix("\ufeff")
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
    Every `TRIM_ROWS` rows the memory that making the batches freed goes back to the system (`release_free_memory`):
    otherwise the C library keeps much of it, and a pass over a large corpus grows with it.
    """
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    rows = trimmed = 0
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
                if rows - trimmed >= TRIM_ROWS:
                    release_free_memory()
                    trimmed = rows
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return rows
