"""Cleaning, deduplication and train/eval overlap as whole columns: Arrow compute, pandas' hashing and NumPy, no loop
per pair; then each split of a corpus cleaned with counts (`clean` for train, `clean_eval` for validation and test).

Each pair gets a drop code (`REASONS`), a 64-bit hash of its exact text (`pandas.util.hash_array`), and whether the
hash of its normalised text is one of validation and test's. Equal hashes only nominate duplicates and overlaps:
they are confirmed by comparing the texts, so a hash collision never drops a pair. The one loop in Python runs over
the nominated pairs only.

Validation and test lose what no model can take (empty, NUL bytes, too long in words, characters or subwords),
counted per split; never duplicates or odd length ratios: they are what is measured.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from nmt.config import DataConfig
from nmt.errors import NmtError
from nmt.tables import arrow_batches, column, normalise, open_arrow, rows, write_rows

REASONS = ("empty", "nul_byte", "too_long", "length_ratio")  # code i + 1; 0 keeps the pair


def drop_codes(src: pa.Array, tgt: pa.Array, cfg: DataConfig) -> np.ndarray:
    """(n,) int8: 0 keeps the pair, i + 1 drops it for REASONS[i] (the first that applies, as in
    `drop_reason`, its one-pair reference)."""
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
# what validation and test drop (`REASONS`): pairs no model can be fed; length_ratio and duplicates stay
EVAL_REASONS = ("empty", "nul_byte", "too_long")


# --- the prepared corpus: cleaning its splits --------------------------------------------------


def drop_reason(src: str, tgt: str, cfg: DataConfig) -> str | None:
    """Why a training pair is dropped, or None to keep it."""
    if not src.strip() or not tgt.strip():
        return "empty"
    if "\x00" in src or "\x00" in tgt:
        return "nul_byte"
    n_src, n_tgt = len(src.split()), len(tgt.split())
    if max(n_src, n_tgt) > cfg.max_words or max(len(src), len(tgt)) > cfg.max_chars:
        return "too_long"
    if max(n_src, n_tgt) > cfg.ratio_min_words and max(n_src, n_tgt) > cfg.max_ratio * max(min(n_src, n_tgt), 1):
        return "length_ratio"
    return None


def clean(ds: datasets.Dataset, cfg: DataConfig, evals: dict[str, datasets.Dataset] | None = None,
          among: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """(N,) bool: the pairs to keep (bad pairs and exact duplicates dropped), and counts per reason. `among` ((N,)
    bool): the rows that are training pairs (the others were carved off for validation or test; None: all).

    Whole columns at a time (`scan`, `repeats`). With `evals` (validation, test), stats["overlap"] counts their
    pairs that also occur in `ds` after normalisation (`normalise`); `cfg.dedupe_eval` drops those
    training pairs ("in_valid_or_test").
    """
    evals = {name: (ev, normalised_hashes(arrow_batches(ev))) for name, ev in (evals or {}).items()}
    other = np.concatenate([np.zeros(0, np.uint64), *(hashes for _, hashes in evals.values())])
    codes, near, hashes = scan(arrow_batches(ds, 10_000), cfg, len(ds), other)
    if cfg.dedupe:  # over every pair: equal pairs share a drop code, so a repeat of a dropped one is dropped
        repeated = repeats(hashes, lambda idx: rows(ds, idx), among)
    del hashes
    if among is not None:
        codes[~among] = -1  # not a training pair: neither kept nor counted
    reasons, counts = np.unique(codes[codes > 0], return_counts=True)
    dropped = Counter({REASONS[r - 1]: int(n) for r, n in zip(reasons, counts)})
    stats = {"read": int(np.count_nonzero(codes >= 0))}
    kept = codes == 0
    del codes
    if cfg.dedupe:
        repeated &= kept
        dropped["duplicate"] = int(np.count_nonzero(repeated))
        kept &= ~repeated
        del repeated
    near &= kept
    if evals:
        in_eval, stats["overlap"] = _eval_overlap(ds, np.flatnonzero(near), evals)
        if cfg.dedupe_eval:
            dropped["in_valid_or_test"] = len(in_eval)
            kept[in_eval] = False
    stats.update(kept=int(np.count_nonzero(kept)), dropped={k: n for k, n in dropped.items() if n})
    return kept, stats


def _eval_overlap(ds: datasets.Dataset, candidates: np.ndarray,
                  evals: dict[str, tuple[datasets.Dataset, np.ndarray]]) -> tuple[np.ndarray, dict]:
    """The kept training rows that equal an eval pair after normalisation (`candidates`: those whose hash says
    they may); and per eval split (its pairs, their `normalised_hashes`), how many of its pairs occur in
    training. Texts are read for the candidates and the eval pairs that share their hashes only."""
    found = rows(ds, candidates, normalised=True)  # one read of the training file
    hashes = np.sort(pair_hashes(*(pa.array(side, pa.string()) for side in zip(*found))) if found else
                     np.zeros(0, np.uint64))
    texts = {name: rows(ev, np.flatnonzero(is_in(ev_hashes, hashes)), normalised=True)
             for name, (ev, ev_hashes) in evals.items()}
    every = set().union(*texts.values())
    in_eval = candidates[np.fromiter((text in every for text in found), bool, len(found))]
    seen = {text for text in found if text in every}
    return in_eval, {name: sum(text in seen for text in pairs) for name, pairs in texts.items()}


def clean_eval(ds: datasets.Dataset, name: str, cfg: DataConfig, work: Path,
               blocks: list[list] | None = None) -> tuple[datasets.Dataset, dict]:
    """Validation or test (`name`) without the pairs of `EVAL_REASONS`, and its counts {"read", "kept", "dropped"}.
    What is kept is a file of its own in `work` (unless nothing was dropped); nothing left is refused by
    `refuse_empty_eval`, once train's own cleaning has had its say. `blocks` ([language pair, rows] in order, a
    multilingual split's) are counted again after the cleaning, in place."""
    keep_codes = [0, *(REASONS.index(r) + 1 for r in REASONS if r not in EVAL_REASONS)]
    codes = np.concatenate([np.zeros(0, np.int8), *(drop_codes(t.column("src"), t.column("tgt"), cfg)
                                                    for t in arrow_batches(ds, 10_000))])
    codes[np.isin(codes, keep_codes)] = 0
    reasons, counts = np.unique(codes[codes > 0], return_counts=True)
    kept = codes == 0
    _recount(blocks, kept)
    stats = {"read": len(ds), "kept": int(np.count_nonzero(kept)),
             "dropped": {REASONS[r - 1]: int(n) for r, n in zip(reasons, counts)}}
    if kept.all() or not kept.any():
        return ds, stats
    out = work / f"{name}.clean.arrow"
    return (open_arrow(out, f"nmt-{work.name}-{out.stem}") if out.is_file() else write_rows(ds, kept, out)), stats


def refuse_empty_eval(stats: dict[str, dict]) -> None:
    """NmtError when cleaning left validation or test (`clean_eval`'s counts by split) without a pair."""
    for name, s in stats.items():
        if s["kept"] == 0:
            raise NmtError(f"no {name} pairs left after cleaning ({s['read']} read; dropped: {s['dropped']}); check "
                           f"data.{name} (or the files it is carved from) or raise data.max_words / data.max_chars")


def _recount(blocks: list[list] | None, kept: np.ndarray) -> None:
    """[language pair, rows] blocks of a split, in order, counted again after a filter `kept` ((N,) bool)."""
    if blocks:
        ends = np.cumsum([n for _, n in blocks])
        for block, part in zip(blocks, np.split(kept, ends[:-1])):
            block[1] = int(np.count_nonzero(part))


def drop_long_eval(ds: datasets.Dataset, name: str, limit: int, stats: dict,
                   blocks: list[list] | None = None) -> datasets.Dataset:
    """Encoded validation or test without pairs longer than `limit` tokens on a side (</s> counted), which the
    model could not take; counted in `stats` (`clean_eval`'s) as too_many_subwords, and in `blocks` (see
    `clean_eval`)."""
    cost = column(ds, "cost")
    if len(cost) == 0 or int(cost.max()) <= limit:
        return ds
    keep = np.flatnonzero(cost <= limit)
    if len(keep) == 0:
        raise NmtError(f"no {name} pairs left: all are longer than {limit} subwords (data.max_subwords, "
                       f"model.max_positions); check data.{name} or raise them")
    stats["dropped"]["too_many_subwords"] = len(cost) - len(keep)
    stats["kept"] = len(keep)
    _recount(blocks, cost <= limit)
    return ds.select(keep)
