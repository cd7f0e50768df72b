"""A `datasets.Dataset` read through its Arrow table: contiguous batches, rows at indices, numeric columns, and
Arrow files opened memory-mapped. Never row by row: datasets gathers a selection one row at a time.

Imported by every module of the data layer before it uses `datasets`, so datasets' progress bars stay off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from nmt import clean as columns
from nmt.compat import dataset_indices

datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()


def open_arrow(path: Path, fingerprint: str) -> datasets.Dataset:
    """The Arrow file at `path`, memory-mapped. `fingerprint` names its content wherever the cache lies (datasets
    would derive one from the path), so the content key of a preparation does not depend on data.cache_dir."""
    from datasets.arrow_reader import ArrowReader

    return datasets.Dataset(ArrowReader.read_table(str(path)), fingerprint=fingerprint)


def arrow_batches(ds: datasets.Dataset, batch_size: int = 50_000) -> Iterator[pa.Table]:
    """`ds` as contiguous Arrow tables of `batch_size` rows: no row formatting, and a selection is one Arrow take
    per batch (datasets itself gathers the rows of a selection one by one, as single-row chunks)."""
    table, mapping = table_and_mapping(ds)
    for start in range(0, len(ds), batch_size):
        if mapping is None:
            yield table.slice(start, batch_size).combine_chunks()
        else:
            yield table.take(mapping[start: start + batch_size])


def table_and_mapping(ds: datasets.Dataset) -> tuple[pa.Table, np.ndarray | None]:
    """The Arrow table under `ds` and the rows of it that `ds` selects (None: all, in order).

    Read through the table, not through datasets' row access, which gathers a selection one row at a time.
    """
    return ds.data.table, dataset_indices(ds)


def rows(ds: datasets.Dataset, idx: np.ndarray, normalised: bool = False) -> list[tuple[str, str]]:
    """(source, target) of the pairs at `idx`, optionally normalised (`nmt.clean.normalise`)."""
    if len(idx) == 0:
        return []
    table, mapping = table_and_mapping(ds)
    table = table.take(idx if mapping is None else mapping[idx])
    src, tgt = table.column("src"), table.column("tgt")
    if normalised:
        src, tgt = columns.normalise(src), columns.normalise(tgt)
    return list(zip(src.to_pylist(), tgt.to_pylist()))


def column(ds: datasets.Dataset, name: str) -> np.ndarray:
    """(N,) a numeric column as NumPy, read through Arrow (never row by row)."""
    table, mapping = table_and_mapping(ds)
    values = table.column(name).to_numpy()
    return values if mapping is None else values[mapping]
