"""The data chapter: a parallel corpus prepared for training. Every input becomes a `datasets.Dataset` with string
columns "src" and "tgt"; it is read, carved into train/valid/test, cleaned with counts, the tokenizer trained and
every split encoded (columns "src_ids", "tgt_ids", their lengths and "cost", padded tokens), all cached by content
(`prepare`). This chapter is the data layer's home of `datasets`, pyarrow and pandas.

In reading order: a Dataset read through its Arrow table (contiguous batches, rows at indices, numeric columns,
Arrow files opened memory-mapped; never row by row); reading a corpus in each of its forms (`load_split`);
cleaning, deduplication and train/eval overlap as whole columns; token ids for a Dataset of pairs, encoded once
into a cached Arrow file; and the prepared corpus itself (`prepare`, `Corpus`).

Validation and test are read like train and lose what no model can take (empty, NUL bytes, too long in words,
characters or subwords), counted per split; never duplicates or odd length ratios: they are what is measured.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import MemoryMappedTable

from nmt.compat import dataset_fingerprint, dataset_indices, generator_yielded_nothing
from nmt.config import BUILTIN, DataConfig, DataSource, TokenizerConfig, lang_tag, to_dict
from nmt.errors import NmtError
from nmt.plan import vocab_size_for
from nmt.textfiles import text_pair_batches, tsv_batches, utf8_lines, write_arrow
from nmt.tokenizer import PairTokenizer, bulk_threads, train_pair_tokenizer

# --- A Dataset read through its Arrow table --------------------------------------------------------------------------
# A `datasets.Dataset` read through its Arrow table: contiguous batches, rows at indices, numeric columns, and
# Arrow files opened memory-mapped. Never row by row: datasets gathers a selection one row at a time.
#
# Imported by every module of the data layer before it uses `datasets`, so datasets' progress bars stay off.

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


# --- Reading a corpus ------------------------------------------------------------------------------------------------
# Reading a parallel corpus into a `datasets.Dataset` with string columns "src" and "tgt": text file pairs, TSV,
# JSONL, CSV, save_to_disk folders, the Hub and the builtin synthetic corpus (`load_split` picks by the spec).

def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        yield from enumerate(utf8_lines(f, path, keep_ends=False), 1)


def read_text_pair(src: str, tgt: str) -> Iterator[dict]:
    """Line i of `src` with line i of `tgt` (as dicts; `load_split` writes them to Arrow in chunks instead)."""
    for batch in text_pair_batches(Path(src), Path(tgt)):
        for a, b in zip(batch.column("src").to_pylist(), batch.column("tgt").to_pylist()):
            yield {"src": a, "tgt": b}


def read_tsv(path: str) -> Iterator[dict]:
    """Column 1 is the source, column 2 the target; further columns (attribution) are ignored."""
    for batch in tsv_batches(Path(path)):
        for a, b in zip(batch.column("src").to_pylist(), batch.column("tgt").to_pylist()):
            yield {"src": a, "tgt": b}


class _KeyTwice(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's keys and values as a dict, refusing a key given twice (`json.loads` keeps the last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _KeyTwice(key)
        out[key] = value
    return out


def read_jsonl(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    for i, line in _lines(Path(path)):
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise NmtError(f"{path}:{i}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        except _KeyTwice as e:
            raise NmtError(f"{path}:{i}: key {e.args[0]!r} is given twice in one object; JSON readers keep only the "
                           "last silently: delete one") from None
        yield _pick_fields(record, src_lang, tgt_lang, f"{path}:{i}")


def read_csv(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    """A header row naming the columns (the languages, or source and target), then one pair per record; a quoted
    field may span lines."""
    with open(path, "rb") as f:
        reader = csv.DictReader(utf8_lines(f, path))
        try:
            for row in reader:
                yield _pick_fields(row, src_lang, tgt_lang, f"{path}:{reader.line_num}")
        except csv.Error as e:  # a field over csv's limit, most often a quote left open
            raise NmtError(f"{path}:{reader.line_num + 1}: the record that starts here is not CSV that can be read "
                           f"({e}); fix or remove it (a field holds at most {csv.field_size_limit():,} characters), or "
                           "give the corpus as .tsv or .jsonl") from None


def _pick_fields(record: dict, src_lang: str, tgt_lang: str, where: str) -> dict:
    """Source/target from {"translation": {src_lang: .., tgt_lang: ..}}, {src_lang: ..}, or {"source": ..}."""
    if not isinstance(record, Mapping):
        raise NmtError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if isinstance(record.get("translation"), Mapping):
        record = record["translation"]
    for src_key, tgt_key in ((src_lang, tgt_lang), ("source", "target"), ("src", "tgt")):
        if src_key in record and tgt_key in record:
            src, tgt = record[src_key], record[tgt_key]
            if not isinstance(src, str) or not isinstance(tgt, str):
                raise NmtError(f"{where}: fields {src_key!r} and {tgt_key!r} must be strings")
            return {"src": src, "tgt": tgt}
    raise NmtError(f"{where}: missing field; expected {src_lang!r} and {tgt_lang!r} (optionally inside "
                   f"'translation'), or 'source' and 'target'; found {sorted(record)}")


@functools.cache
def _builtin_splits() -> dict:
    from nmt.synthetic import builtin_splits

    return builtin_splits()


def read_builtin(split: str) -> Iterator[dict]:
    for src, tgt in _builtin_splits()[split]:
        yield {"src": src, "tgt": tgt}


def load_split(spec: str, cfg: DataConfig, split: str, cache: Path, whole_ok: bool = True) -> datasets.Dataset | None:
    """The Dataset (columns src, tgt) that `spec` names for `split`.

    A source with named splits (builtin, save_to_disk DatasetDict, Hub) gives that split or None;
    a single-split source gives all of itself, or None when `whole_ok` is False.
    """
    if spec == BUILTIN:
        return _from_generator(read_builtin, {"split": split}, cache)
    if spec.startswith("hub:"):
        return _from_dataset_dict(_load_hub(spec[4:]), spec, cfg, split, whole_ok)
    path = Path(spec)
    if path.is_dir():
        return _from_dataset_dict(_load_disk(path), spec, cfg, split, whole_ok)
    if not whole_ok:
        return None
    suffix = path.suffix.lower()
    if suffix == ".tsv":
        return _from_arrow_file(lambda: tsv_batches(path), "tsv", _stamp(path), cache)
    if suffix in (".jsonl", ".json"):
        return _from_generator(read_jsonl, {"path": str(path), "src_lang": cfg.src_lang,
                                            "tgt_lang": cfg.tgt_lang, "stamp": _stamp(path)}, cache)
    if suffix == ".csv":
        return _from_generator(read_csv, {"path": str(path), "src_lang": cfg.src_lang,
                                          "tgt_lang": cfg.tgt_lang, "stamp": _stamp(path)}, cache)
    src, tgt = Path(f"{path}.{cfg.src_lang}"), Path(f"{path}.{cfg.tgt_lang}")
    for p in (src, tgt):
        if not p.is_file():
            raise NmtError(f"data file not found: {p} (from {spec!r}: give a prefix of .{cfg.src_lang}/.{cfg.tgt_lang} "
                           "files, a .tsv/.jsonl/.csv file, a save_to_disk folder, hub:NAME or builtin:synthetic)")
    return _from_arrow_file(lambda: text_pair_batches(src, tgt), "text", _stamp(src) + _stamp(tgt), cache)


def _from_arrow_file(batches: Callable[[], Iterator[pa.RecordBatch]], kind: str, stamp: str,
                     cache: Path) -> datasets.Dataset:
    """The text read once into an Arrow file named by the files' stamps, then opened memory-mapped."""
    out = cache / "read" / f"{kind}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.stem}")


def _stamp(path: Path) -> str:
    """Changes when the file does, so the reading cache never serves stale text."""
    if not path.is_file():
        raise NmtError(f"data file not found: {path}")
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _from_generator(fn: Callable, kwargs: dict, cache: Path) -> datasets.Dataset:
    # kwargs (with the file stamp) key datasets' own cache; NmtError raised inside is unwrapped
    def gen(**kw):  # a closure keeps the reader's exceptions ours
        yield from fn(**{k: v for k, v in kw.items() if k != "stamp"})
    gen.__name__ = f"nmt_{fn.__name__}"
    features = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(gen, gen_kwargs=kwargs, features=features,
                                               cache_dir=str(cache / "datasets"))
    except Exception as e:  # datasets wraps generator errors in DatasetGenerationError
        cause = e
        while cause is not None and not isinstance(cause, NmtError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if generator_yielded_nothing(e):
            where = kwargs.get("path") or " + ".join(str(kwargs[k]) for k in ("src", "tgt") if k in kwargs)
            raise NmtError(f"no training pairs in {where or kwargs} (empty file?)") from None
        raise


def _load_disk(path: Path):
    try:
        return datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise NmtError(f"{path}: a folder, but not one written by Dataset.save_to_disk") from None


def _load_hub(name: str):
    repo, _, config = name.partition(":")
    try:
        return datasets.load_dataset(repo, config or None)
    except Exception as e:
        raise NmtError(f"hub:{name}: could not load from the Hugging Face Hub ({str(e).splitlines()[0]}); "
                       "offline, save it with save_to_disk elsewhere and pass the folder") from None


SPLIT_NAMES = {"train": ("train",), "valid": ("validation", "valid", "dev"), "test": ("test",)}


def _from_dataset_dict(obj, spec: str, cfg: DataConfig, split: str, whole_ok: bool) -> datasets.Dataset | None:
    if not isinstance(obj, datasets.DatasetDict) and not whole_ok:
        return None
    if isinstance(obj, datasets.DatasetDict):
        name = next((n for n in SPLIT_NAMES[split] if n in obj), None)
        if name is None:
            if split == "train":
                raise NmtError(f"{spec}: no train split (found {', '.join(obj)})")
            return None
        obj = obj[name]
    return obj.map(_normalize_record, fn_kwargs={"src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang,
                                                 "where": spec}, remove_columns=obj.column_names)


def _normalize_record(record: dict, src_lang: str, tgt_lang: str, where: str) -> dict:
    return _pick_fields(record, src_lang, tgt_lang, where)


# --- Cleaning, deduplication and overlap -----------------------------------------------------------------------------
# Cleaning, deduplication and train/eval overlap as whole columns: Arrow compute, pandas' hashing and NumPy, no
# loop per pair.
#
# Each pair gets a drop code (`REASONS`), a 64-bit hash of its exact text (`pandas.util.hash_array`), and whether the
# hash of its normalised text is one of validation and test's. Equal hashes only nominate duplicates and overlaps:
# they are confirmed by comparing the texts, so a hash collision never drops a pair. The one loop in Python runs over
# the nominated pairs only.

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


# --- Token ids -------------------------------------------------------------------------------------------------------
# Token ids for a Dataset of pairs: encoded once into a cached Arrow file (columns of `ENCODED`), with each pair's
# lengths and padded cost; too long training pairs dropped with counts.

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


# --- The prepared corpus ---------------------------------------------------------------------------------------------

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")
# what validation and test drop (`REASONS`): pairs no model can be fed; length_ratio and duplicates stay
EVAL_REASONS = ("empty", "nul_byte", "too_long")
PREPARED_FORMAT = 2  # part of the cache key: bumped when what prepare writes under a key changes
log = logging.getLogger(__name__)


@dataclass
class Mixing:
    """Which training pairs each epoch reads when several corpora are mixed (`data.weights`, `data.temperature`):
    corpus i gives `draws[i]` pairs an epoch, as whole copies of itself and, for the rest, a sample of its pairs
    drawn anew each epoch from `seed` and the epoch (the same on every process, so resume and N processes agree).
    A corpus a temperature shrinks is thus seen in turn, not cut to one fixed subset."""

    origin: np.ndarray  # (N,) the corpus of each training pair
    draws: list[int]
    seed: int

    def rows(self, epoch: int) -> np.ndarray:
        """(sum(draws),) indices into the training split: epoch `epoch`'s pairs, corpus by corpus."""
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        for i, n_draws in enumerate(self.draws):
            idx = np.flatnonzero(self.origin == i)
            whole, rest = divmod(n_draws, len(idx))
            parts += [idx] * whole + [np.sort(rng.choice(idx, size=rest, replace=False))]
        return np.concatenate(parts)


@dataclass
class CorpusStats:
    """What preparing a corpus found: read by training, `nmt check` and the log lines, and written as the run's
    data.json (`as_dict`)."""

    pairs: dict[str, int]  # each split's pairs, as training reads them
    clean: dict  # what cleaning did to train: {"read", "kept", "dropped": {reason: pairs}, "overlap": {split: pairs}}
    clean_eval: dict[str, dict]  # and to valid and test: {"read", "kept", "dropped"}
    sizing_pairs: int  # the training pairs left after cleaning: what sizes the vocabulary (and the plan's model)
    vocab_size: int | None  # the vocabulary size chosen and trained with; None for a tokenizer given
    fingerprints: dict[str, str]  # each split's files' sha256: what a resume checks (`nmt.checkpoint.FINGERPRINTS`)
    carved_from_train: list[str]  # the splits carved off the training corpus
    corpora: list  # each training corpus's pairs; with several, its line of the mixing (`mix`)
    cache: str  # the directory of the prepared entry
    seconds: dict[str, float]  # each phase's time
    eval_pairs: dict[str, list] = field(default_factory=dict)  # of several pairs: each eval split's [pair, rows]

    def as_dict(self) -> dict:
        """The JSON of data.json and training.json's "data" (eval_pairs only where a run has several pairs)."""
        out = dataclasses.asdict(self)
        if not self.eval_pairs:
            del out["eval_pairs"]
        return out


@dataclass
class Corpus:
    """Encoded splits, their tokenizer, what preparing them found, and how several training corpora are mixed."""

    splits: dict[str, datasets.Dataset]
    tokenizer: PairTokenizer
    stats: CorpusStats
    mixing: Mixing | None = None

    @property
    def epoch_rows(self) -> Callable[[int], np.ndarray] | None:
        """`epoch -> indices` of the training pairs an epoch reads (`Mixing.rows`); None: every pair once."""
        return None if self.mixing is None else self.mixing.rows


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


def overlap_line(stats: CorpusStats) -> str | None:
    """One line for the log: validation/test pairs that also occur in train; None when there are none."""
    overlap = stats.clean.get("overlap") or {}
    if not any(overlap.values()):
        return None
    found = " and ".join(f"{n} {name}" for name, n in overlap.items())
    removed = stats.clean["dropped"].get("in_valid_or_test")
    then = (f"data.dedupe_eval removed {removed} training pairs" if removed is not None
            else "set data.dedupe_eval: true to remove them from train")
    return f"{found} pairs also occur in the training data (after normalisation); {then}"


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


def eval_clean_line(stats: CorpusStats) -> str | None:
    """One line for the log: what cleaning dropped from validation and test (None when nothing), e.g.
    "cleaning dropped 1 of 40 valid pairs (too_long 1) and 0 of 40 test pairs: ..."."""
    splits = stats.clean_eval
    if not any(s["dropped"] for s in splits.values()):
        return None
    parts = [f"{s['read'] - s['kept']} of {s['read']} {name} pairs"
             + (f" ({', '.join(f'{reason} {n}' for reason, n in s['dropped'].items())})" if s["dropped"] else "")
             for name, s in splits.items()]
    return f"cleaning dropped {' and '.join(parts)}: empty or too long for the model, they are not scored"


# --- the prepared corpus: the whole preparation -------------------------------------------------


def prepare(cfg: DataConfig, tok_cfg: TokenizerConfig, main_first: Callable[[], ContextManager] | None = None,
            tokenizer: PairTokenizer | None = None, splits: tuple[str, ...] = SPLITS,
            max_positions: int | None = None) -> Corpus:
    """Read, carve, clean, train the tokenizer (unless given) and encode, all cached by content.

    `main_first` (e.g. nmt.launch.main_process_first) lets the main process fill the cache while the
    others wait and then read it. A null `tok_cfg.vocab_size` is the plan's (`nmt.plan.vocab_size_for`) for the number of
    training pairs left after cleaning, recorded as stats.sizing_pairs, the size trained with as stats.vocab_size
    (what the plan records: it is chosen here, once, because the tokenizer is trained before the plan can run; None
    for a given tokenizer). stats.seconds times each phase (`CorpusStats`).
    Every split keeps only pairs of at most data.max_subwords tokens a side, and at most `max_positions` (the
    model's) when given. stats.clean counts what cleaning did to train, stats.clean_eval to valid and test.
    """
    from contextlib import nullcontext

    cache_root = Path(cfg.cache_dir)
    cache_root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    with (main_first or nullcontext)():
        with _timed(seconds, "read"):
            raw, split_stats, among = _read_splits(cfg, cache_root)
        eval_pairs = split_stats.get("eval_pairs", {})
        if tokenizer is not None:
            _check_tags(tokenizer, cfg)
        tok_cfg = with_tags(tok_cfg, cfg)
        key = _content_key(raw, cfg, tok_cfg, None)
        if tokenizer is not None and not _holds_tokenizer(cache_root / "prepared" / key, tokenizer):
            key = _content_key(raw, cfg, tok_cfg, tokenizer)
        work = cache_root / "prepared" / key
        work.mkdir(parents=True, exist_ok=True)
        with _timed(seconds, "clean"):
            eval_stats = {}
            for name in EVAL_SPLITS:  # before train's: its overlap with them is counted against what they keep
                raw[name], eval_stats[name] = clean_eval(raw[name], name, cfg, work, eval_pairs.get(name))
            raw["train"], clean_stats, kept = _cached_clean(raw, cfg, work, among, split_stats.pop("rows"))
            refuse_empty_eval(eval_stats)
            del among
        sizing_pairs = len(raw["train"])
        if tok_cfg.vocab_size is None:
            tok_cfg = dataclasses.replace(tok_cfg, vocab_size=vocab_size_for(sizing_pairs))
            # the entry's key holds the open size: the chosen one keys the tokenizer and the encodings, so a run
            # trains the vocabulary its plan prints, whichever size an earlier nmt chose for the same data
            work = work / f"vocab-{tok_cfg.vocab_size}"
            work.mkdir(exist_ok=True)
        vocab_size = None if tokenizer is not None else tok_cfg.vocab_size
        with _timed(seconds, "tokenizer"):
            tokenizer = tokenizer or _cached_tokenizer(raw["train"], tok_cfg, work)
        with _timed(seconds, "encode"):
            encoded = {name: encode(raw[name], tokenizer, work / f"{name}.encoded.arrow") for name in splits}
        del raw  # the encoded files hold what training reads; the raw splits' row mappings go
    limit = min(cfg.max_subwords, max_positions or cfg.max_subwords)
    if "train" in encoded:
        encoded["train"], clean_stats, mixing = _trained_on(encoded["train"], cfg, clean_stats, kept, split_stats,
                                                            limit)
    for name in EVAL_SPLITS:
        if name in encoded:
            encoded[name] = drop_long_eval(encoded[name], name, limit, eval_stats[name], eval_pairs.get(name))
    stats = CorpusStats(pairs={name: len(ds) for name, ds in encoded.items()}, clean=clean_stats,
                        clean_eval=eval_stats, sizing_pairs=sizing_pairs, vocab_size=vocab_size, seconds=seconds,
                        cache=str(work), **split_stats)
    if line := eval_clean_line(stats):
        log.info("%s", line)
    return Corpus(encoded, tokenizer, stats, mixing if "train" in encoded else None)


def with_tags(tok_cfg: TokenizerConfig, cfg: DataConfig) -> TokenizerConfig:
    """`tok_cfg` with the target-language tags of a multilingual run (`DataConfig.tags`) reserved: each a token of
    its own, never split or learnt from the text."""
    missing = [tag for tag in cfg.tags() if tag not in tok_cfg.reserved]
    return dataclasses.replace(tok_cfg, reserved=[*tok_cfg.reserved, *missing]) if missing else tok_cfg


def _check_tags(tokenizer: PairTokenizer, cfg: DataConfig) -> None:
    """A tokenizer given (a resumed run's, a model fine-tuned) holds every target-language tag the data needs."""
    missing = [tag for tag in cfg.tags() if tokenizer.src.token_to_id(tag) is None]
    if missing:
        raise NmtError(f"the tokenizer has no token for the target-language tag(s) {', '.join(missing)} that data.train "
                       f"needs ({', '.join(cfg.pairs())}); train a new model, or keep its target languages")


def _trained_on(train: datasets.Dataset, cfg: DataConfig, clean_stats: dict, kept: list[int],
                split_stats: dict, limit: int) -> tuple[datasets.Dataset, dict, Mixing | None]:
    """The encoded training pairs training reads, those over `limit` tokens dropped, and how several corpora are
    mixed by their weights and the temperature (`kept`: how many pairs of each corpus cleaning kept, in order)."""
    train, clean_stats, long_kept = drop_long(train, limit, clean_stats)
    mixing = None
    if len(kept) > 1:
        origin = np.repeat(np.arange(len(kept)), kept)
        mixing, split_stats["corpora"] = mix(origin if long_kept is None else origin[long_kept], cfg)
    return train, clean_stats, mixing


@contextmanager
def _timed(seconds: dict, name: str):
    start = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - start, 3)


def train_specs(cfg: DataConfig) -> list[str]:
    """The training corpora's paths: data.train as a list."""
    return [c.path for c in cfg.corpora("train")]


def epoch_shares(sizes: list[int], weights: list[float], temperature: float) -> np.ndarray:
    """(C,) each corpus's share of an epoch: its weighted size (pairs times weight) raised to 1/temperature,
    normalised. Temperature 1 is proportional to the weighted sizes; a large one tends to equal shares."""
    m = np.asarray(sizes, float) * np.asarray(weights, float)
    scaled = np.exp((np.log(m) - np.log(m).max()) / temperature)  # m ** (1/T) without overflow
    return scaled / scaled.sum()


def epoch_draws(sizes: list[int], weights: list[float], temperature: float) -> list[int]:
    """Pairs drawn from each corpus per epoch. An epoch keeps the weighted total (sum of pairs times weight),
    divided by `epoch_shares`; at temperature 1 corpus i gives exactly its pairs times its weight (whole copies
    and a rounded fraction), so with weights 1 each pair is seen once per epoch."""
    if temperature == 1.0:
        return [int(w) * n + round((w % 1.0) * n) for n, w in zip(sizes, weights)]
    total = sum(n * w for n, w in zip(sizes, weights))
    return [max(1, round(share * total)) for share in epoch_shares(sizes, weights, temperature)]


def mix(origin: np.ndarray, cfg: DataConfig) -> tuple[Mixing, list[dict]]:
    """The mixing of the training corpora (each drawn `epoch_draws` times an epoch, by data.weights and
    data.temperature) and each one's line of the stats. `origin` (N,) is the corpus of each training pair."""
    sources = cfg.corpora("train")
    sizes = [int(np.count_nonzero(origin == i)) for i in range(len(sources))]
    if 0 in sizes:
        empty = sources[sizes.index(0)].path
        raise NmtError(f"data.train {empty}: no pairs left after cleaning; check the file or drop it from data.train")
    draws = epoch_draws(sizes, [s.weight for s in sources], cfg.temperature)
    corpora = [{"train": source.path, "pair": source.pair, "pairs": n, "weight": source.weight, "per_epoch": n_draws,
                "share": round(n_draws / sum(draws), 4)} for source, n, n_draws in zip(sources, sizes, draws)]
    return Mixing(origin, draws, cfg.split_seed), corpora


def corpora_line(stats: CorpusStats) -> str | None:
    """One line for the log: each training corpus's pairs per epoch and share, when there are several."""
    corpora = stats.corpora
    if not corpora or not isinstance(corpora[0], dict):
        return None
    shown = ", ".join(f"{c['pair']} {c['train']} {c['per_epoch']:,} of {c['pairs']:,} ({100 * c['share']:.1f}%)"
                      for c in corpora)
    return f"training corpora per epoch (pairs drawn of pairs kept, share): {shown}"


def _with_langs(cfg: DataConfig, source: DataSource) -> DataConfig:
    """`cfg` reading `source`'s languages (a reader takes the file suffixes and JSON fields from data.*_lang)."""
    if (source.src_lang, source.tgt_lang) == (cfg.src_lang, cfg.tgt_lang):
        return cfg
    return dataclasses.replace(cfg, src_lang=source.src_lang, tgt_lang=source.tgt_lang)


def tagged(ds: datasets.Dataset, tag: str, cache: Path) -> datasets.Dataset:
    """`ds` with `tag` before every source: the target-language tag of a multilingual run, a reserved token of the
    tokenizer (its own id). Written without a space: the tokenizer splits a reserved token off by itself, and a
    space before another tag (<bt>) would be a token of its own. A file of its own in `cache`/read, keyed by the
    content and the tag."""
    key = hashlib.sha256(f"{dataset_fingerprint(ds)}:{len(ds)}:{tag}:glued".encode()).hexdigest()[:16]
    out = cache / "read" / f"tagged-{key}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)

        def batches() -> Iterator[pa.RecordBatch]:
            for table in arrow_batches(ds):
                src = pa.compute.binary_join_element_wise(tag, table.column("src"), "")
                yield from table.select(["tgt"]).add_column(0, "src", src).select(["src", "tgt"]).to_batches()

        write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def _read_splits(cfg: DataConfig, cache: Path) -> tuple[dict[str, datasets.Dataset], dict, np.ndarray | None]:
    """train, valid and test: from their own specs, from the first train corpus's named splits, or carved off it;
    and (N,) bool, the rows of train that stay training pairs when some were carved off (else None). Further
    training corpora are appended to train; stats["corpora"] holds each one's training pairs.

    A multilingual run (`DataConfig.is_multilingual`) reads each corpus with its own languages, its sources
    tagged with their target language, and holds validation and test out of every training corpus (the same rows
    of two directions of one corpus, so neither direction trains on the other's held-out pairs);
    stats["eval_pairs"] holds each validation and test split's language pairs, in order, with their rows."""
    sources, multi = cfg.corpora("train"), cfg.is_multilingual
    parts = [_read_train(source, cfg, cache) for source in sources]
    splits, carved, stays = {"train": parts[0]}, [], [np.ones(len(p), dtype=bool) for p in parts]
    eval_pairs = {}
    for name, ratio in (("valid", cfg.valid_ratio), ("test", cfg.test_ratio)):
        given, pieces, carving = cfg.corpora(name), [], False
        for source in given or (sources if multi else sources[:1]):
            spec_cfg = _with_langs(cfg, source)
            ds = load_split(source.path, spec_cfg, name, cache, whole_ok=bool(given))
            if ds is not None and multi:
                ds = tagged(ds, lang_tag(source.tgt_lang), cache)
            elif ds is None:
                if ratio <= 0:
                    raise NmtError(f"config key 'data.{name}': no {name} set given and data.{name}_ratio is 0")
                i, carving = sources.index(source), True
                ds = _carve(parts[i], stays[i], name, ratio, seed=cfg.split_seed + len(carved), cache=cache)
            pieces.append((source.pair, ds))
        if carving:
            carved.append(name)
        splits[name] = pieces[0][1] if len(pieces) == 1 else datasets.concatenate_datasets([p for _, p in pieces])
        eval_pairs[name] = [[pair, len(p)] for pair, p in pieces]
    sizes = [int(np.count_nonzero(s)) for s in stays]
    for name, ds in splits.items():
        if (sizes[0] if name == "train" else len(ds)) == 0:
            raise NmtError(f"the {name} split is empty (from {getattr(cfg, name) or sources[0].path!r})")
    if len(parts) > 1:
        splits["train"] = datasets.concatenate_datasets(parts)
    among = None if all(s.all() for s in stays) else np.concatenate(stays)
    stats = {"carved_from_train": carved, "corpora": sizes, "fingerprints": split_fingerprints(splits),
             "rows": [len(p) for p in parts]}
    if multi:
        stats["eval_pairs"] = eval_pairs
    return splits, stats, among


def _read_train(source: DataSource, cfg: DataConfig, cache: Path) -> datasets.Dataset:
    train = load_split(source.path, _with_langs(cfg, source), "train", cache)
    if len(train) == 0:
        raise NmtError(f"no training pairs in {source.path!r} (empty file?)")
    if cfg.max_train_pairs is not None:
        train = train.select(range(min(cfg.max_train_pairs, len(train))))
    if cfg.is_multilingual:
        train = tagged(train, lang_tag(source.tgt_lang), cache)
    return train


def _carve(train: datasets.Dataset, stays: np.ndarray, name: str, ratio: float, *, seed: int,
          cache: Path) -> datasets.Dataset:
    """The `name` split: a share `ratio` (rounded up) of the training pairs left (`stays`, (N,) bool, updated in
    place), drawn with `seed`, carved off; refused when either side would be empty. Train stays its file (cleaning
    writes the pairs it keeps to a file of their own); the held-out pairs get a small file of their own, so reading
    them never touches the pages of the whole corpus."""
    left = int(np.count_nonzero(stays))
    held = math.ceil(ratio * left)
    if not 0 < held < left:
        raise NmtError(f"config key 'data.{name}': {left} training pair(s) left are too few to carve a {name} set "
                       f"of data.{name}_ratio={ratio} from; give data.{name} (a separate file) or more pairs")
    key = f"{dataset_fingerprint(train)}:{ratio}:{seed}:{hashlib.sha256(np.packbits(stays).data).hexdigest()}"
    order = np.flatnonzero(stays)
    np.random.default_rng(seed).shuffle(order)
    picked = np.zeros(len(stays), dtype=bool)
    picked[order[:held]] = True
    del order
    stays &= ~picked
    out = cache / "read" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        return write_rows(train, picked, out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def split_fingerprints(raw: dict[str, datasets.Dataset]) -> dict[str, str]:
    """Per split, the sha256 of what the cache key is made of: its content fingerprint and length (a file is known
    by path, size and modification time, as the reading cache knows it), so a resume on changed data names it."""
    return {name: hashlib.sha256(f"{name}:{dataset_fingerprint(raw[name])}:{len(raw[name])}".encode()).hexdigest()
            for name in SPLITS}


def _holds_tokenizer(work: Path, tokenizer: PairTokenizer) -> bool:
    """Cache entry `work` trained `tokenizer`: given again (a resumed run's own), it reuses that entry's files."""
    if not (work / "tokenizer").is_dir():
        return False
    return PairTokenizer.load(work / "tokenizer").same_as(tokenizer)


def _content_key(raw: dict[str, datasets.Dataset], cfg: DataConfig, tok_cfg: TokenizerConfig,
                 tokenizer: PairTokenizer | None) -> str:
    h = hashlib.sha256(f"format {PREPARED_FORMAT};".encode())
    for name in SPLITS:
        h.update(f"{name}:{dataset_fingerprint(raw[name])}:{len(raw[name])};".encode())
    # BPE-dropout changes only the training pairs' per-epoch segmentation (DropoutEpochs), not what is cached here;
    # the mixing weights only select from the encoded pairs
    tok = to_dict(tok_cfg) | {"dropout": None}
    data = to_dict(cfg) | {"cache_dir": None, "weights": None, "temperature": None, "shared_cache": None}
    h.update(json.dumps({"data": data, "tok": tok}, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(tokenizer.src.to_str().encode() + tokenizer.tgt.to_str().encode())
    return h.hexdigest()[:16]


def _cached_clean(raw: dict[str, datasets.Dataset], cfg: DataConfig, work: Path, among: np.ndarray | None,
                  rows: list[int]) -> tuple[datasets.Dataset, dict, list[int]]:
    """The cleaned training split (its own Arrow file unless cleaning kept every row), the cleaning stats and how
    many pairs of each corpus it kept (`rows`: each one's rows in the file, in order; `among`: see `clean`)."""
    train, clean_file, stats_file = raw["train"], work / "train.clean.arrow", work / "clean.json"
    saved = json.loads(stats_file.read_text()) if stats_file.is_file() else None
    if saved is None or not (saved["whole"] or clean_file.is_file()):
        kept, stats = clean(train, cfg, {name: raw[name] for name in ("valid", "test")}, among)
        if stats["kept"] == 0:
            raise NmtError(f"no training pairs left after cleaning ({stats['read']} read; dropped: "
                           f"{stats['dropped']}); check the files or relax data.max_words / data.max_ratio")
        saved = {"stats": stats, "whole": bool(kept.all()),
                 "per_corpus": [int(np.count_nonzero(part)) for part in np.split(kept, np.cumsum(rows)[:-1])]}
        if not saved["whole"]:
            train = write_rows(train, kept, clean_file)  # written before the stats, which mark the pair complete
        del kept
        # a temporary name of our own: two runs may fill the same cache at once (the last rename wins)
        (work / f".clean.{os.getpid()}").write_text(json.dumps(saved))
        os.replace(work / f".clean.{os.getpid()}", stats_file)
    elif not saved["whole"]:
        train = open_arrow(clean_file, f"nmt-{work.name}-{clean_file.stem}")  # as write_rows opens it
    return train, saved["stats"], saved["per_corpus"]


def _cached_tokenizer(train: datasets.Dataset, tok_cfg: TokenizerConfig, work: Path) -> PairTokenizer:
    tok_dir = work / "tokenizer"
    if tok_dir.is_dir():
        return PairTokenizer.load(tok_dir)
    picked = np.ones(len(train), dtype=bool)
    if tok_cfg.train_sample is not None and tok_cfg.train_sample < len(train):
        picked[:] = False  # a sample the same on every run and process, read in file order
        picked[np.random.default_rng(0).choice(len(train), size=tok_cfg.train_sample, replace=False)] = True

    def texts(name: str) -> Callable[[], Iterator[list[str]]]:  # batches of one side, as tokenizers takes them
        def batches() -> Iterator[list[str]]:
            start = 0
            for table in arrow_batches(train, 10_000):
                yield table.column(name).filter(pa.array(picked[start: start + len(table)])).to_pylist()
                start += len(table)
        return batches

    with bulk_threads():
        tokenizer = train_pair_tokenizer(texts("src"), texts("tgt"), tok_cfg, int(picked.sum()))
    tmp = Path(tempfile.mkdtemp(dir=work, prefix=".tokenizer-"))
    tokenizer.save(tmp)
    try:
        os.replace(tmp, tok_dir)
    except OSError:  # another run filling the same cache got there first: use its (identical) tokenizer
        shutil.rmtree(tmp, ignore_errors=True)
        return PairTokenizer.load(tok_dir)
    return tokenizer
