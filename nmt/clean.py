"""Cleaning, deduplication and train/eval overlap as whole columns: Arrow compute, pandas' hashing and NumPy, no
loop per pair.

Each pair gets a drop code (`REASONS`), a 64-bit hash of its exact text (`pandas.util.hash_array`), and whether the
hash of its normalised text is one of validation and test's. Equal hashes only nominate duplicates and overlaps:
they are confirmed by comparing the texts, so a hash collision never drops a pair. The one loop in Python runs over
the nominated pairs only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from nmt.config import DataConfig

REASONS = ("empty", "nul_byte", "too_long", "length_ratio")  # code i + 1; 0 keeps the pair


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


def pair_hashes(src: pa.Array, tgt: pa.Array) -> np.ndarray:
    """(n,) uint64 hash of each (source, target) pair: the two sides joined by a unit separator, hashed by pandas.
    Two pairs that differ only where the separator sits hash alike: the texts decide (`repeats`)."""
    joined = pc.binary_join_element_wise(pc.fill_null(src, ""), pc.fill_null(tgt, ""), "\x1f")
    return pd.util.hash_array(joined.to_numpy(zero_copy_only=False), categorize=False)


def repeats(hashes: np.ndarray, texts: Callable[[np.ndarray], list], among: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: True where an earlier element has the same text. `hashes` ((n,) `pair_hashes`) nominate; `texts(idx)`
    gives the texts at `idx` (any comparable values), read only for elements whose hash is not unique. `among`
    ((n,) bool): only those elements count, as if the others were not there (None: all)."""
    out = np.zeros(len(hashes), dtype=bool)
    idx = np.arange(len(hashes)) if among is None else np.flatnonzero(among)
    candidates = idx[pd.Series(hashes[idx]).duplicated(keep=False).to_numpy()]
    seen: set = set()
    for i, text in zip(candidates, texts(candidates)):  # ascending: the first occurrence is kept
        out[i] = text in seen
        seen.add(text)
    return out


def scan(batches: Iterable[pa.Table], cfg: DataConfig, n: int,
         other: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n,) drop codes, (n,) bool, True where the normalised pair's hash is one of `other`'s (e.g.
    `normalised_hashes` of validation and test), and (n,) the exact `pair_hashes`, of a corpus of `n` pairs read in
    batches, a few at a time on one thread per core (Arrow compute releases the GIL)."""
    other = np.sort(np.zeros(0, np.uint64) if other is None else other)
    codes, near, hashes = np.zeros(n, np.int8), np.zeros(n, bool), np.zeros(n, np.uint64)
    threads, done = os.cpu_count() or 1, 0
    with ThreadPoolExecutor(threads) as pool:
        window = list(itertools.islice(iter_batches := iter(batches), threads))
        while window:
            for code, exact, close in pool.map(lambda table: _scan_one(table, cfg, other), window):
                size = len(code)
                codes[done: done + size], hashes[done: done + size], near[done: done + size] = code, exact, close
                done += size
            window = list(itertools.islice(iter_batches, threads))
    if done != n:
        raise ValueError(f"scan: {done} pairs read, {n} expected")
    return codes, near, hashes


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
