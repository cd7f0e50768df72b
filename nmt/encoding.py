"""Token ids for a Dataset of pairs: encoded once into a cached Arrow file (columns of `ENCODED`), with each pair's
lengths and padded cost; too long training pairs dropped with counts.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nmt.errors import NmtError
from nmt.tables import arrow_batches, column, open_arrow, table_and_mapping
from nmt.textfiles import write_arrow
from nmt.tokenizer import PairTokenizer, bulk_threads

IDS = pa.list_(pa.int32())
ENCODED = pa.schema([("src", pa.string()), ("tgt", pa.string()), ("src_ids", IDS), ("tgt_ids", IDS),
                     ("src_len", pa.int32()), ("tgt_len", pa.int32()), ("cost", pa.int32())])


def _encode_batch(batch: pa.Table, tokenizer: PairTokenizer) -> pa.RecordBatch:
    src_ids = tokenizer.encode_src(batch.column("src").to_pylist())
    tgt_ids = tokenizer.encode_tgt(batch.column("tgt").to_pylist())
    src_len = np.fromiter(map(len, src_ids), np.int32, len(src_ids))
    tgt_len = np.fromiter(map(len, tgt_ids), np.int32, len(tgt_ids)) + 1  # + </s>, as the decoder sees it
    return pa.record_batch([batch.column("src").combine_chunks(), batch.column("tgt").combine_chunks(),
                            pa.array(src_ids, IDS), pa.array(tgt_ids, IDS), src_len, tgt_len,
                            np.maximum(src_len, tgt_len)], schema=ENCODED)


def pair_cost(src_ids: list[int], tgt_ids: list[int]) -> int:
    """Padded tokens a pair needs: the decoder sees <s> + tgt and predicts tgt + </s>, len(tgt) + 1 positions."""
    return max(len(src_ids), len(tgt_ids) + 1)


def encode(ds: datasets.Dataset, tokenizer: PairTokenizer, cache_file: Path) -> datasets.Dataset:
    """Tokenize into an Arrow file (columns of `ENCODED`) opened memory-mapped; a second call with the same
    cache file re-tokenizes nothing. Batches go through the tokenizer's own threads (`bulk_threads`)."""
    if not cache_file.is_file():
        with bulk_threads():
            write_arrow((_encode_batch(t, tokenizer) for t in arrow_batches(ds, 10_000)), cache_file, ENCODED)
    return open_arrow(cache_file, f"nmt-{cache_file.parent.name}-{cache_file.stem}")


def pair_lengths(ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(N,) source lengths (subwords + </s>) and (N,) target lengths as the decoder sees them (+ </s>)."""
    if "src_len" in ds.column_names and "tgt_len" in ds.column_names:
        return column(ds, "src_len"), column(ds, "tgt_len")
    table, mapping = table_and_mapping(ds)
    side = lambda name: pc.list_value_length(table.column(name)).to_numpy()
    src, tgt = side("src_ids"), side("tgt_ids") + 1
    return (src, tgt) if mapping is None else (src[mapping], tgt[mapping])


def source_lengths(ds: datasets.Dataset) -> np.ndarray:
    """(N,) source lengths alone (a sampler's ties), as `pair_lengths` gives them: one column read, not both."""
    return column(ds, "src_len") if "src_len" in ds.column_names else pair_lengths(ds)[0]


def drop_long(train: datasets.Dataset, max_subwords: int,
              stats: dict) -> tuple[datasets.Dataset, dict, np.ndarray | None]:
    """Drop training pairs longer than `max_subwords` subwords on either side, counting them; also returns the
    indices kept (None: all of them)."""
    cost = column(train, "cost")
    if len(cost) == 0 or int(cost.max()) <= max_subwords:
        return train, stats, None
    keep = np.flatnonzero(cost <= max_subwords)
    if len(keep) == 0:
        raise NmtError(f"no training pairs left: all are longer than data.max_subwords={max_subwords}")
    dropped = {**stats["dropped"], "too_many_subwords": len(cost) - len(keep)}
    return train.select(keep), {**stats, "kept": len(keep), "dropped": dropped}, keep
