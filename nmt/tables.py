"""A `datasets.Dataset` read through its Arrow table: contiguous batches, rows at indices, numeric columns, and
Arrow files opened memory-mapped. Never row by row: datasets gathers a selection one row at a time.

Imported by every module of the data layer before it uses `datasets`, so datasets' progress bars stay off.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import MemoryMappedTable  # datasets 5.2.0: a table over a memory-mapped file, by its path

from nmt import clean as columns
from nmt.batching import narrow_type
from nmt.compat import dataset_fingerprint, dataset_indices, dataset_with_indices, memory_mapped_rows
from nmt.textfiles import write_arrow

FAULT_AROUND = 1 << 16  # bytes: Linux maps up to this much of cached file pages around a read fault

datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()


def open_arrow(path: Path, fingerprint: str) -> datasets.Dataset:
    """The Arrow file at `path`, memory-mapped. `fingerprint` names its content wherever the cache lies (datasets
    would derive one from the path), so the content key of a preparation does not depend on data.cache_dir.
    Opening reads every batch's header and offsets (~7 bytes a pair of pages): they are handed back as it goes."""
    pages = _map(path)
    table = pa.Table.from_batches(list(_mapped_batches(pages)), _stream_schema(pages))
    return datasets.Dataset(MemoryMappedTable(table, str(path)), fingerprint=fingerprint)  # re-opened by path when pickled


def _map(path: Path | str) -> mmap.mmap:
    """The file at `path`, memory-mapped read-only; unmapped when the last Arrow buffer over it goes."""
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def _stream_schema(pages: mmap.mmap) -> pa.Schema:
    return pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(pages))).schema


def _mapped_batches(pages: mmap.mmap) -> Iterator[pa.RecordBatch]:
    """The record batches of the Arrow stream in `pages`, zero-copy. The pages read up to a batch's end leave this
    process's memory when the next batch is asked for: they stay in the page cache and map again when read again
    (Linux's MADV_DONTNEED; elsewhere they stay). Each range handed back starts FAULT_AROUND before the last one
    ended: a read fault maps the cached pages around it too, some of them already handed back."""
    source, done = pa.BufferReader(pa.py_buffer(pages)), 0
    for batch in pa.ipc.open_stream(source):
        yield batch
        if hasattr(mmap, "MADV_DONTNEED") and source.tell() > done:
            pages.madvise(mmap.MADV_DONTNEED, done, source.tell() - done)
            done = max(source.tell() - FAULT_AROUND, 0) // mmap.PAGESIZE * mmap.PAGESIZE


def arrow_batches(ds: datasets.Dataset, batch_size: int = 50_000) -> Iterator[pa.Table]:
    """`ds` as contiguous Arrow tables of `batch_size` rows: no row formatting, and a selection is one Arrow take
    per batch (datasets itself gathers the rows of a selection one by one, as single-row chunks).

    A whole pass over an Arrow file of ours (all rows, or a selection in file order) reads the file instead of
    its memory map: the pages read stay in the page cache, not in this process's memory (`_streamed`).
    """
    table, mapping = table_and_mapping(ds)
    source = memory_mapped_rows(ds)
    if source is not None and (mapping is None or bool(np.all(mapping[1:] > mapping[:-1]))):
        yield from _streamed(*source, len(table), mapping, table.schema, batch_size)
        return
    for start in range(0, len(ds), batch_size):
        if mapping is None:
            yield table.slice(start, batch_size).combine_chunks()
        else:
            yield take(table, mapping[start: start + batch_size])


def _streamed(path: str, first: int, rows: int, mapping: np.ndarray | None, schema: pa.Schema,
              batch_size: int) -> Iterator[pa.Table]:
    """Rows `first + mapping` (ascending; None: `first` to `first + rows`) of the Arrow stream at `path`, in tables of
    `batch_size` rows, read batch by batch with plain reads: memory holds a batch or two, never the file."""
    pending: list[pa.RecordBatch] = []
    held = end = 0
    with pa.OSFile(path) as source, pa.ipc.open_stream(source) as reader:
        for batch in reader:
            start, end = end, end + batch.num_rows  # file rows in this batch; the table's rows are shifted by `first`
            if mapping is None:
                batch = batch.slice(max(first - start, 0), max(min(first + rows, end) - max(first, start), 0))
            else:
                lo, hi = np.searchsorted(mapping, [max(start - first, 0), max(end - first, 0)])
                batch = batch.take(pa.array(mapping[lo:hi].astype(np.int64) + (first - start)))
            pending.append(batch)
            held += batch.num_rows
            while held >= batch_size:
                table = pa.Table.from_batches(pending, reader.schema)
                yield table.slice(0, batch_size).combine_chunks().replace_schema_metadata(schema.metadata)
                pending, held = table.slice(batch_size).to_batches(), held - batch_size
            if end >= first + rows:
                break
        if held:
            yield pa.Table.from_batches(pending, reader.schema).combine_chunks().replace_schema_metadata(schema.metadata)


def take(table: pa.Table, idx: np.ndarray) -> pa.Table:
    """Rows `idx` of `table`, gathered batch by batch: Arrow's own take first joins every chunk of a column into
    one array, so a few rows of a memory-mapped file would read and copy whole columns."""
    idx = np.asarray(idx, dtype=np.int64)
    batches = table.to_batches()
    starts = np.cumsum([0, *(batch.num_rows for batch in batches)])
    chunk = np.searchsorted(starts, idx, side="right") - 1
    order = np.argsort(chunk, kind="stable")
    bounds = np.flatnonzero(np.diff(chunk[order], prepend=-1, append=len(batches)))
    parts = [batches[chunk[order[lo]]].take(pa.array(idx[order[lo:hi]] - starts[chunk[order[lo]]]))
             for lo, hi in zip(bounds[:-1], bounds[1:])]
    gathered = pa.Table.from_batches(parts, table.schema).combine_chunks()
    return gathered.take(pa.array(np.argsort(order)))


def table_and_mapping(ds: datasets.Dataset) -> tuple[pa.Table, np.ndarray | None]:
    """The Arrow table under `ds` and the rows of it that `ds` selects (None: all, in order).

    Read through the table, not through datasets' row access, which gathers a selection one row at a time.
    """
    return ds.data.table, dataset_indices(ds)


def rows(ds: datasets.Dataset, idx: np.ndarray, normalised: bool = False) -> list[tuple[str, str]]:
    """(source, target) of the pairs at `idx`, optionally normalised (`nmt.clean.normalise`)."""
    if len(idx) == 0:
        return []
    table = gather(ds, np.asarray(idx, dtype=np.int64))
    src, tgt = table.column("src"), table.column("tgt")
    if normalised:
        src, tgt = columns.normalise(src), columns.normalise(tgt)
    return list(zip(src.to_pylist(), tgt.to_pylist()))


def gather(ds: datasets.Dataset, idx: np.ndarray) -> pa.Table:
    """Rows `idx` of `ds`. From an Arrow file of ours they are read from the file, front to back: gathering a few
    rows through its memory map touches a few MiB of every batch they lie in (Arrow's take reads whole buffers)."""
    table, mapping = table_and_mapping(ds)
    at = idx if mapping is None else mapping[idx].astype(np.int64)
    source = memory_mapped_rows(ds)
    if source is None or len(at) == 0:
        return take(table, at)
    order = np.argsort(at, kind="stable")
    found = pa.concat_tables(_streamed(*source, len(table), at[order], table.schema, len(at)))
    return found.take(pa.array(np.argsort(order)))


def select(ds: datasets.Dataset, idx: np.ndarray) -> datasets.Dataset:
    """`ds.select(idx)` at NumPy's cost (`nmt.compat.dataset_with_indices`). The fingerprint follows the parent's
    and the rows selected."""
    mapping = dataset_indices(ds)
    picked = np.asarray(idx, dtype=np.int64)
    picked = (picked.view(np.uint64) if mapping is None else mapping[picked]).astype(np.uint64, copy=False)
    digest = hashlib.sha256(dataset_fingerprint(ds).encode())
    digest.update(np.ascontiguousarray(picked).data)  # the indices' bytes, not a copy of them
    return dataset_with_indices(ds, picked, digest.hexdigest()[:16])


def write_rows(ds: datasets.Dataset, keep: np.ndarray, out: Path) -> datasets.Dataset:
    """The rows of `ds` where `keep` ((N,) bool) is True, columns src and tgt, written batch by batch to the Arrow
    file `out` and opened memory-mapped: unlike a selection, nothing of 8 bytes a row stays in memory."""

    def batches() -> Iterator[pa.RecordBatch]:
        start = 0
        for table in arrow_batches(ds):
            part, start = table.filter(pa.array(keep[start: start + len(table)])), start + len(table)
            yield from part.select(["src", "tgt"]).to_batches()

    write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def column(ds: datasets.Dataset, name: str, narrow: bool = False) -> np.ndarray:
    """(N,) a numeric column as NumPy, read through Arrow (never row by row). `narrow`: an integer column in the
    smallest type that holds its values (`nmt.batching.narrow`; lengths: 1-2 bytes a pair), filled chunk by chunk,
    never copied whole in its stored type (int32 lengths: 4 bytes a pair); from an Arrow file of ours, through a
    memory map of its own whose pages are handed back as it reads (`_mapped_batches`): none stay in this process."""
    table, mapping = table_and_mapping(ds)
    values = table.column(name)
    if narrow and pa.types.is_integer(values.type) and len(values):
        source = memory_mapped_rows(ds)

        def chunks():  # read twice (range, then values); from the file, each read through a memory map of its own
            return values.chunks if source is None else _file_chunks(*source, len(table), name)

        low_high = [pc.min_max(chunk).values() for chunk in chunks() if len(chunk)]
        low, high = min(lo.as_py() for lo, _ in low_high), max(hi.as_py() for _, hi in low_high)
        out, start = np.empty(len(values), dtype=narrow_type(low, high)), 0
        for chunk in chunks():
            out[start: start + len(chunk)] = chunk.to_numpy()
            start += len(chunk)
        values = out
    else:
        values = values.to_numpy()
    return values if mapping is None else values[mapping]


def _file_chunks(path: str, first: int, rows: int, name: str) -> Iterator[pa.Array]:
    """Column `name` of file rows `first` to `first + rows` of the Arrow stream at `path`, batch by batch, from a
    memory map opened here (`_mapped_batches`); the map goes with the last chunk the caller drops."""
    end = 0
    for batch in _mapped_batches(_map(path)):
        start, end = end, end + batch.num_rows
        lo, hi = max(first - start, 0), min(first + rows, end) - start
        if hi > lo:
            yield batch.column(name).slice(lo, hi - lo)
        if end >= first + rows:
            return
