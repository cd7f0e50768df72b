"""Cleaning, deduplication and train/eval overlap as whole columns: Arrow compute and NumPy, no loop per pair.

Each pair gets a drop code (`REASONS`), a 64-bit hash of its exact text and one of its normalised text.
Equal hashes only nominate duplicates: they are confirmed by comparing the texts, so a hash collision
never drops a pair. The one loop in Python runs over the nominated pairs only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nmt.config import DataConfig

REASONS = ("empty", "nul_byte", "too_long", "length_ratio")  # code i + 1; 0 keeps the pair

_MULT = (0x100000001B3, 0x9E3779B97F4A7C15)  # odd multipliers: invertible modulo 2**64
_powers: dict[int, tuple[np.ndarray, np.ndarray]] = {}


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
    """(n,) uint64 polynomial hash of each string's UTF-8 bytes (modulo 2**64), computed with cumulative sums."""
    text = pc.fill_null(pc.cast(text, pa.large_string()), "")
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset: text.offset + len(text) + 1]
    data = text.buffers()[2]
    raw = np.frombuffer(data, dtype=np.uint8)[offsets[0]: offsets[-1]] if data is not None else np.zeros(0, np.uint8)
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
        size = max(n, 1 << 16)
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


def repeats(hashes: np.ndarray, texts: Callable[[np.ndarray], list]) -> np.ndarray:
    """(n,) bool: True where an earlier element has the same text. `texts(idx)` gives the texts at `idx`
    (any comparable values); they are read only for elements whose hash is not unique."""
    order = np.argsort(hashes, kind="stable")
    same = hashes[order][1:] == hashes[order][:-1]
    nominated = np.zeros(len(hashes), dtype=bool)
    nominated[order[1:][same]] = nominated[order[:-1][same]] = True
    candidates = np.flatnonzero(nominated)
    out = np.zeros(len(hashes), dtype=bool)
    seen: set = set()
    for i, text in zip(candidates, texts(candidates)):  # ascending: the first occurrence is kept
        out[i] = text in seen
        seen.add(text)
    return out


def scan(batches: Iterable[pa.Table], cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N,) drop codes, (N,) exact pair hashes and (N,) normalised pair hashes of a corpus read in batches.

    Batches are scanned on one thread per core (Arrow compute and NumPy release the GIL), a few at a time, so
    memory holds a few batches, never the corpus.
    """
    threads = os.cpu_count() or 1
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with ThreadPoolExecutor(threads) as pool:
        window = list(itertools.islice(iter_batches := iter(batches), threads))
        while window:
            parts += pool.map(lambda table: _scan_one(table, cfg), window)
            window = list(itertools.islice(iter_batches, threads))
    if not parts:
        return np.zeros(0, np.int8), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return tuple(np.concatenate(column) for column in zip(*parts))  # type: ignore[return-value]


def _scan_one(table: pa.Table, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, tgt = table.column("src"), table.column("tgt")
    return drop_codes(src, tgt, cfg), pair_hashes(src, tgt), pair_hashes(normalise(src), normalise(tgt))


def in_other(hashes: np.ndarray, other: np.ndarray, texts: Callable[[np.ndarray], list], other_texts: set) -> np.ndarray:
    """(n,) bool: True where the element's text is in `other_texts` (`other` holds their hashes); `texts(idx)`
    gives the texts at idx, read only where the hash matches."""
    other = np.sort(other)  # small (validation + test): a binary search per element, no copy of `hashes` sorted
    found = other[np.minimum(np.searchsorted(other, hashes), max(len(other) - 1, 0))] if len(other) else other
    candidates = np.flatnonzero(found == hashes) if len(other) else np.zeros(0, np.int64)
    out = np.zeros(len(hashes), dtype=bool)
    out[candidates] = [text in other_texts for text in texts(candidates)]
    return out
