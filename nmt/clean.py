"""Cleaning, deduplication and train/eval overlap as whole columns: Arrow compute and NumPy, no loop per pair.

Each pair gets a drop code (`REASONS`), a 64-bit hash of its exact text, and whether the hash of its normalised
text is one of validation and test's. Equal hashes only nominate duplicates and overlaps: they are confirmed by
comparing the texts, so a hash collision never drops a pair. The one loop in Python runs over the nominated pairs
only. The exact hashes go to disk as they are made (`HashSpill`, 16 parts by their top bits) and are sorted one
part at a time, so per pair memory holds ~2 bytes from the scan (drop code, eval flag) and ~2 more while the
dedupe runs, never the hashes or the texts of the whole corpus.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nmt.compat import release_free_memory
from nmt.config import DataConfig

REASONS = ("empty", "nul_byte", "too_long", "length_ratio")  # code i + 1; 0 keeps the pair

_MULT = (0x100000001B3, 0x9E3779B97F4A7C15)  # odd multipliers: invertible modulo 2**64
_powers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
SPAN = 1 << 18  # bytes of text hashed at once


def drop_codes(src: pa.Array, tgt: pa.Array, cfg: DataConfig) -> np.ndarray:
    """(n,) int8: 0 keeps the pair, i + 1 drops it for REASONS[i] (the first that applies, as in
    nmt.data.drop_reason, its one-pair reference)."""
    words = [word_counts(side) for side in (src, tgt)]
    chars = [pc.utf8_length(side).to_numpy(zero_copy_only=False) for side in (src, tgt)]
    longest, shortest = np.maximum(*words), np.minimum(*words)
    code = np.zeros(len(src), dtype=np.int8)
    code[(longest > cfg.ratio_min_words) & (longest > cfg.max_ratio * np.maximum(shortest, 1))] = 4
    code[(longest > cfg.max_words) | (np.maximum(*chars) > cfg.max_chars)] = 3
    nul = [pc.match_substring(side, "\x00").to_numpy(zero_copy_only=False) for side in (src, tgt)]
    code[nul[0] | nul[1]] = 2
    code[(words[0] == 0) | (words[1] == 0)] = 1  # only whitespace: Python's `not s.strip()`
    return code


def word_counts(text: pa.Array) -> np.ndarray:
    """(n,) len(s.split()) of each string: Arrow's Unicode whitespace is Python's (bidi WS, B, S or category Zs)."""
    trimmed = pc.utf8_trim_whitespace(text)
    counts = pc.list_value_length(pc.utf8_split_whitespace(trimmed)).to_numpy(zero_copy_only=False)
    return np.where(pc.utf8_length(trimmed).to_numpy(zero_copy_only=False) == 0, 0, counts)


def normalise(text: pa.Array) -> pa.Array:
    """NFKC, lower case, whitespace runs as one space, trimmed: how eval pairs are matched against train."""
    return pc.binary_join(pc.utf8_split_whitespace(pc.utf8_trim_whitespace(pc.utf8_lower(pc.utf8_normalize(text, "NFKC")))),
                          " ")


def string_hashes(text: pa.Array, which: int = 0) -> np.ndarray:
    """(n,) uint64 polynomial hash of each string's UTF-8 bytes (modulo 2**64), computed with cumulative sums over
    runs of strings of about `SPAN` bytes: the power tables and the temporaries stay that size, whatever the batch."""
    text = pc.fill_null(pc.cast(text, pa.large_string()), "")
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset: text.offset + len(text) + 1]
    data = text.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    out, lo = np.empty(len(text), dtype=np.uint64), 0
    while lo < len(text):
        hi = min(max(int(np.searchsorted(offsets, offsets[lo] + SPAN, side="right")) - 1, lo + 1), len(text))
        out[lo:hi] = _span_hashes(data, offsets[lo: hi + 1], which)
        lo = hi
    return out


def _span_hashes(data: np.ndarray, offsets: np.ndarray, which: int) -> np.ndarray:
    """The hashes of the strings at `offsets` ((n + 1,), ascending) of the bytes `data`."""
    raw = data[offsets[0]: offsets[-1]]
    power, inverse = _power_table(len(raw) + 1, which)
    with np.errstate(over="ignore"):
        terms = raw.astype(np.uint64)  # in place from here: one temporary of 8 bytes per byte of text
        terms += np.uint64(1)
        terms *= power[: len(raw)]
        prefix = np.zeros(len(raw) + 1, dtype=np.uint64)
        np.cumsum(terms, out=prefix[1:])
        del terms
        start, end = offsets[:-1] - offsets[0], offsets[1:] - offsets[0]
        return (prefix[end] - prefix[start]) * inverse[start] + (end - start).astype(np.uint64)


def _power_table(n: int, which: int) -> tuple[np.ndarray, np.ndarray]:
    """mult**k and mult**-k (mod 2**64) for k < n, cached and grown as needed."""
    have = _powers.get(which)
    if have is None or len(have[0]) < n:
        size = max(n, SPAN + 1)
        with np.errstate(over="ignore"):
            mult = np.full(size, _MULT[which], dtype=np.uint64)
            inv = np.full(size, pow(_MULT[which], -1, 1 << 64), dtype=np.uint64)
            mult[0] = inv[0] = 1
            have = _powers[which] = (np.cumprod(mult), np.cumprod(inv))
    return have


def pair_hashes(src: pa.Array, tgt: pa.Array) -> np.ndarray:
    """(n,) uint64 hash of each (source, target) pair."""
    with np.errstate(over="ignore"):
        return string_hashes(src, 0) * np.uint64(_MULT[1]) ^ string_hashes(tgt, 1)


class HashSpill:
    """(hash, row) records written to `PARTS` files in `folder` by the hash's top bits as a corpus is scanned, and
    read back one part at a time: equal hashes meet in one part, rows ascend inside each part."""

    RECORD = np.dtype([("hash", "<u8"), ("row", "<i8")])
    PARTS = 16

    def __init__(self, folder: Path):
        self.paths = [Path(folder) / f"hashes-{k:02d}.bin" for k in range(self.PARTS)]
        self.files = [open(path, "wb") for path in self.paths]
        self.rows = 0

    def add(self, hashes: np.ndarray) -> None:
        """The hashes of the next len(hashes) rows."""
        part = (hashes >> np.uint64(60)).astype(np.uint8)
        order = np.argsort(part, kind="stable")
        records = np.empty(len(hashes), self.RECORD)
        records["hash"], records["row"] = hashes[order], order + self.rows
        bounds = np.searchsorted(part[order], np.arange(self.PARTS + 1))
        for file, lo, hi in zip(self.files, bounds[:-1], bounds[1:]):
            file.write(records[lo:hi].tobytes())
        self.rows += len(hashes)

    def parts(self) -> Iterator[np.ndarray]:
        for file in self.files:
            file.close()
        for path in self.paths:
            yield np.fromfile(path, self.RECORD)


def repeats(parts: Iterable[np.ndarray], n: int, texts: Callable[[np.ndarray], list],
            among: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: True where an earlier element has the same text. `parts`: (hash, row) records of the n
    elements, equal hashes in the same part (`HashSpill.parts`). `texts(idx)` gives the texts at `idx` (any
    comparable values); they are read only for elements whose hash is not unique, one part at a time. `among`
    ((n,) bool): only those elements count, as if the others were not there (None: all).
    """
    out = np.zeros(n, dtype=bool)
    for records in parts:
        if among is not None:
            records = records[among[records["row"]]]
        order = np.argsort(records["hash"], kind="stable")
        ordered = records["hash"][order]
        same = ordered[1:] == ordered[:-1]
        nominated = np.zeros(len(records), dtype=bool)
        nominated[1:][same] = nominated[:-1][same] = True
        candidates = np.sort(records["row"][order[nominated]])
        del records, order, ordered, same, nominated
        seen: set = set()
        for i, text in zip(candidates, texts(candidates)):  # ascending: the first occurrence is kept
            out[i] = text in seen
            seen.add(text)
    return out


def scan(batches: Iterable[pa.Table], cfg: DataConfig, n: int, other: np.ndarray | None = None,
         spill: HashSpill | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(n,) drop codes and (n,) bool, True where the normalised pair's hash is one of `other`'s (e.g.
    `normalised_hashes` of validation and test), of a corpus of `n` pairs read in batches; the exact pair
    hashes go to `spill`.

    Batches are scanned on one thread per core (Arrow compute and NumPy release the GIL), a few at a time, into
    arrays allocated once: memory holds those and a few batches, never the corpus. The threads' freed memory
    is handed back after each few batches (`release_free_memory`), so it does not pile up in their heaps.
    """
    other = np.sort(np.zeros(0, np.uint64) if other is None else other)
    codes, near = np.zeros(n, np.int8), np.zeros(n, bool)
    threads, done = os.cpu_count() or 1, 0
    with ThreadPoolExecutor(threads) as pool:
        window = list(itertools.islice(iter_batches := iter(batches), threads))
        while window:
            for code, exact, close in pool.map(lambda table: _scan_one(table, cfg, other), window):
                size = len(code)
                codes[done: done + size], near[done: done + size] = code, close
                if spill is not None:
                    spill.add(exact)
                done += size
            del code, exact, close
            release_free_memory()
            window = list(itertools.islice(iter_batches, threads))
    if done != n:
        raise ValueError(f"scan: {done} pairs read, {n} expected")
    return codes, near


def _scan_one(table: pa.Table, cfg: DataConfig, other: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, tgt = table.column("src"), table.column("tgt")
    return drop_codes(src, tgt, cfg), pair_hashes(src, tgt), is_in(_normalised_pair_hashes(table), other)


def normalised_hashes(batches: Iterable[pa.Table]) -> np.ndarray:
    """(N,) hashes of each pair's normalised text (`normalise`) of a corpus read in batches."""
    return np.concatenate([np.zeros(0, np.uint64), *map(_normalised_pair_hashes, batches)])


def _normalised_pair_hashes(table: pa.Table) -> np.ndarray:
    return pair_hashes(normalise(table.column("src")), normalise(table.column("tgt")))


def is_in(hashes: np.ndarray, other: np.ndarray) -> np.ndarray:
    """(n,) bool: each hash occurs in `other` (sorted; small, e.g. validation + test: a binary search each).
    Equal hashes only nominate: the caller confirms with the texts."""
    if len(other) == 0:
        return np.zeros(len(hashes), dtype=bool)
    return other[np.minimum(np.searchsorted(other, hashes), len(other) - 1)] == hashes
