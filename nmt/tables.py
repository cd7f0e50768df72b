"""A `datasets.Dataset` read through its Arrow table: contiguous batches, rows at indices, numeric columns, and
Arrow files opened memory-mapped; never row by row (datasets gathers a selection one row at a time).

Imported by every module of the data layer before it uses `datasets`, so datasets' progress bars stay off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import MemoryMappedTable

from nmt.compat import dataset_indices
from nmt.textfiles import write_arrow

datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()


def open_arrow(path: Path, fingerprint: str) -> datasets.Dataset:
    """The Arrow file at `path`, memory-mapped. `fingerprint` names its content wherever the cache lies (datasets
    would derive one from the path), so the content key of a preparation does not depend on data.cache_dir."""
    return datasets.Dataset(MemoryMappedTable.from_file(str(path)), fingerprint=fingerprint)


def arrow_batches(ds: datasets.Dataset, batch_size: int = 50_000) -> Iterator[pa.Table]:
    """`ds` as contiguous Arrow tables of `batch_size` rows: no row formatting, and a selection is one Arrow take
    per batch (datasets itself gathers the rows of a selection one by one)."""
    table, mapping = table_and_mapping(ds)
    for start in range(0, len(ds), batch_size):
        if mapping is None:
            yield table.slice(start, batch_size).combine_chunks()
        else:
            yield table.take(mapping[start: start + batch_size]).combine_chunks()


def table_and_mapping(ds: datasets.Dataset) -> tuple[pa.Table, np.ndarray | None]:
    """The Arrow table under `ds` and the rows of it that `ds` selects (None: all, in order)."""
    return ds.data.table, dataset_indices(ds)


def rows(ds: datasets.Dataset, idx: np.ndarray, normalised: bool = False) -> list[tuple[str, str]]:
    """(source, target) of the pairs at `idx`, optionally normalised (`normalise`)."""
    if len(idx) == 0:
        return []
    table, mapping = table_and_mapping(ds)
    idx = np.asarray(idx, dtype=np.int64)
    picked = table.select(["src", "tgt"]).take(idx if mapping is None else mapping[idx])
    src, tgt = picked.column("src"), picked.column("tgt")
    if normalised:
        src, tgt = normalise(src), normalise(tgt)
    return list(zip(src.to_pylist(), tgt.to_pylist()))


def write_rows(ds: datasets.Dataset, keep: np.ndarray, out: Path) -> datasets.Dataset:
    """The rows of `ds` where `keep` ((N,) bool) is True, columns src and tgt, written batch by batch to the Arrow
    file `out` and opened memory-mapped."""

    def batches() -> Iterator[pa.RecordBatch]:
        start = 0
        for table in arrow_batches(ds):
            part, start = table.filter(pa.array(keep[start: start + len(table)])), start + len(table)
            yield from part.select(["src", "tgt"]).to_batches()

    write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def column(ds: datasets.Dataset, name: str) -> np.ndarray:
    """(N,) a numeric column as NumPy, read through Arrow (never row by row)."""
    table, mapping = table_and_mapping(ds)
    values = table.column(name).to_numpy()
    return values if mapping is None else values[mapping]

def normalise(text: pa.Array) -> pa.Array:
    """NFKC, lower case, whitespace runs as one space, trimmed: how eval pairs are matched against train."""
    return pc.binary_join(pc.utf8_split_whitespace(pc.utf8_trim_whitespace(pc.utf8_lower(pc.utf8_normalize(text, "NFKC")))),
                          " ")
