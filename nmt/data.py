"""Parallel corpora on `datasets`: read any supported input, clean with counts, encode with a cache.

The one home of the `datasets` library. Every input becomes a Dataset with string columns
"src" and "tgt"; encoding adds "src_ids", "tgt_ids" and "cost" (padded tokens the pair needs).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nmt import clean as columns
from nmt.compat import dataset_fingerprint, dataset_indices
from nmt.config import BUILTIN, DataConfig, TokenizerConfig, TrainConfig, auto_sizes, to_dict
from nmt.errors import NmtError
from nmt.textfiles import count_lines as count_lines
from nmt.textfiles import decode_line, text_pair_batches, tsv_batches, write_arrow
from nmt.tokenizer import EOS, DropoutSegmenter, PairTokenizer, bulk_threads, train_pair_tokenizer

datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()

SPLITS = ("train", "valid", "test")


@dataclass
class Corpus:
    """Encoded splits, their tokenizer, and what cleaning dropped."""

    splits: dict[str, datasets.Dataset]
    tokenizer: PairTokenizer
    stats: dict = field(default_factory=dict)


# --- reading ------------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            yield i, decode_line(raw, path, i)


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


def read_jsonl(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    for i, line in _lines(Path(path)):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise NmtError(f"{path}:{i}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        yield _pick_fields(record, src_lang, tgt_lang, f"{path}:{i}")


def read_csv(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        try:
            for i, row in enumerate(csv.DictReader(f), 2):
                yield _pick_fields(row, src_lang, tgt_lang, f"{path}:{i}")
        except UnicodeDecodeError:
            raise NmtError(f"{path}: not valid UTF-8; convert the file, e.g. iconv -f latin1 -t utf-8") from None


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


# --- from a spec to a Dataset --------------------------------------------------------------------


def load_split(spec: str, cfg: DataConfig, split: str, cache: Path, whole_ok: bool = True) -> datasets.Dataset | None:
    """The Dataset (columns src, tgt) that `spec` names for `split`.

    A source with named splits (builtin, save_to_disk DatasetDict, Hub) gives that split or None;
    a single-split source gives all of itself, or None when `whole_ok` is False.
    """
    if spec == BUILTIN:
        return _from_generator(read_builtin, {"split": split}, cache)
    if spec.startswith("hub:"):
        return _from_dataset_dict(_load_hub(spec[4:]), spec, cfg, split, whole_ok)
    path = Path(spec).expanduser()
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


def open_arrow(path: Path, fingerprint: str) -> datasets.Dataset:
    """The Arrow file at `path`, memory-mapped. `fingerprint` names its content wherever the cache lies (datasets
    would derive one from the path), so the content key of a preparation does not depend on data.cache_dir."""
    from datasets.arrow_reader import ArrowReader

    return datasets.Dataset(ArrowReader.read_table(str(path)), fingerprint=fingerprint)


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
        if "corresponds to no data" in str(e):  # the generator yielded nothing
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


# --- cleaning -----------------------------------------------------------------------------------


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


def clean(ds: datasets.Dataset, cfg: DataConfig,
          evals: dict[str, datasets.Dataset] | None = None) -> tuple[np.ndarray, dict]:
    """Indices of the pairs to keep (bad pairs and exact duplicates dropped), and counts per reason.

    Whole columns at a time (`nmt.clean`). With `evals` (validation, test), stats["overlap"] counts their
    pairs that also occur in `ds` after normalisation (`nmt.clean.normalise`); `cfg.dedupe_eval` drops those
    training pairs ("in_valid_or_test").
    """
    codes, exact, norm = columns.scan(arrow_batches(ds, 10_000), cfg)
    keep = np.flatnonzero(codes == 0)
    reasons, counts = np.unique(codes[codes > 0], return_counts=True)
    dropped = Counter({columns.REASONS[r - 1]: int(n) for r, n in zip(reasons, counts)})
    if cfg.dedupe:
        repeated = columns.repeats(exact[keep], lambda idx: rows(ds, keep[idx]))
        dropped["duplicate"] = int(repeated.sum())
        keep = keep[~repeated]
    stats = {"read": len(codes)}
    if evals:
        in_eval, stats["overlap"] = _eval_overlap(ds, keep, norm[keep], evals, cfg)
        if cfg.dedupe_eval:
            dropped["in_valid_or_test"] = int(in_eval.sum())
            keep = keep[~in_eval]
    stats.update(kept=len(keep), dropped={k: n for k, n in dropped.items() if n})
    return keep.astype(np.int64), stats


def _eval_overlap(ds: datasets.Dataset, keep: np.ndarray, norm: np.ndarray, evals: dict[str, datasets.Dataset],
                  cfg: DataConfig) -> tuple[np.ndarray, dict]:
    """(len(keep),) bool: kept training pairs that equal an eval pair after normalisation; and per eval split,
    how many of its pairs occur in training."""
    eval_texts = {name: rows(ev, np.arange(len(ev)), normalised=True) for name, ev in evals.items()}
    eval_hashes = np.concatenate([columns.scan(arrow_batches(ev), cfg)[2] for ev in evals.values()])
    every = set().union(*eval_texts.values())
    in_eval = columns.in_other(norm, eval_hashes, lambda idx: rows(ds, keep[idx], normalised=True), every)
    seen = set(rows(ds, keep[in_eval], normalised=True))
    overlap = {name: sum(text in seen for text in texts) for name, texts in eval_texts.items()}
    return in_eval, overlap


def arrow_batches(ds: datasets.Dataset, batch_size: int = 50_000) -> Iterator[pa.Table]:
    """`ds` as contiguous Arrow tables of `batch_size` rows: no row formatting, and a selection is one Arrow take
    per batch (datasets itself gathers the rows of a selection one by one, as single-row chunks)."""
    table, mapping = _table_and_mapping(ds)
    for start in range(0, len(ds), batch_size):
        if mapping is None:
            yield table.slice(start, batch_size).combine_chunks()
        else:
            yield table.take(mapping[start: start + batch_size])


def _table_and_mapping(ds: datasets.Dataset) -> tuple[pa.Table, np.ndarray | None]:
    """The Arrow table under `ds` and the rows of it that `ds` selects (None: all, in order).

    Read through the table, not through datasets' row access, which gathers a selection one row at a time.
    """
    return ds.data.table, dataset_indices(ds)


def rows(ds: datasets.Dataset, idx: np.ndarray, normalised: bool = False) -> list[tuple[str, str]]:
    """(source, target) of the pairs at `idx`, optionally normalised (`nmt.clean.normalise`)."""
    if len(idx) == 0:
        return []
    table, mapping = _table_and_mapping(ds)
    table = table.take(idx if mapping is None else mapping[idx])
    src, tgt = table.column("src"), table.column("tgt")
    if normalised:
        src, tgt = columns.normalise(src), columns.normalise(tgt)
    return list(zip(src.to_pylist(), tgt.to_pylist()))


def column(ds: datasets.Dataset, name: str) -> np.ndarray:
    """(N,) a numeric column as NumPy, read through Arrow (never row by row)."""
    table, mapping = _table_and_mapping(ds)
    values = table.column(name).to_numpy()
    return values if mapping is None else values[mapping]


def overlap_line(stats: dict) -> str | None:
    """One line for the log: validation/test pairs that also occur in train; None when there are none."""
    overlap = stats.get("clean", {}).get("overlap") or {}
    if not any(overlap.values()):
        return None
    found = " and ".join(f"{n} {name}" for name, n in overlap.items())
    removed = stats["clean"]["dropped"].get("in_valid_or_test")
    then = (f"data.dedupe_eval removed {removed} training pairs" if removed is not None
            else "set data.dedupe_eval: true to remove them from train")
    return f"{found} pairs also occur in the training data (after normalisation); {then}"


# --- encoding -----------------------------------------------------------------------------------


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
        return column(ds, "src_len").astype(np.int64), column(ds, "tgt_len").astype(np.int64)
    table, mapping = _table_and_mapping(ds)
    side = lambda name: pc.list_value_length(table.column(name)).to_numpy().astype(np.int64)
    src, tgt = side("src_ids"), side("tgt_ids") + 1
    return (src, tgt) if mapping is None else (src[mapping], tgt[mapping])


def drop_long(train: datasets.Dataset, max_subwords: int, stats: dict) -> tuple[datasets.Dataset, dict, np.ndarray]:
    """Drop training pairs longer than `max_subwords` subwords on either side, counting them; also returns the
    indices kept."""
    cost = column(train, "cost")
    keep = np.flatnonzero(cost <= max_subwords)
    if len(keep) == len(cost):
        return train, stats, keep
    if len(keep) == 0:
        raise NmtError(f"no training pairs left: all are longer than data.max_subwords={max_subwords}")
    dropped = {**stats["dropped"], "too_many_subwords": len(cost) - len(keep)}
    return train.select(keep), {**stats, "kept": len(keep), "dropped": dropped}, keep


# --- the whole preparation -----------------------------------------------------------------------


def prepare(cfg: DataConfig, tok_cfg: TokenizerConfig, main_first: Callable[[], ContextManager] | None = None,
            tokenizer: PairTokenizer | None = None, splits: tuple[str, ...] = SPLITS) -> Corpus:
    """Read, carve, clean, train the tokenizer (unless given) and encode, all cached by content.

    `main_first` (e.g. nmt.launch.main_process_first) lets the main process fill the cache while the
    others wait and then read it. A null `tok_cfg.vocab_size` is chosen by `auto_sizes` from the number of
    training pairs left after cleaning, recorded as stats["sizing_pairs"]. stats["seconds"] times each phase.
    """
    from contextlib import nullcontext

    cache_root = Path(os.path.expanduser(cfg.cache_dir))
    cache_root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    with (main_first or nullcontext)():
        with _timed(seconds, "read"):
            raw, split_stats = _read_splits(cfg, cache_root)
        key = _content_key(raw, cfg, tok_cfg, tokenizer)
        work = cache_root / "prepared" / key
        work.mkdir(parents=True, exist_ok=True)
        with _timed(seconds, "clean"):
            raw["train"], clean_stats, kept = _cached_clean(raw, cfg, work)
        sizing_pairs = len(raw["train"])
        if tok_cfg.vocab_size is None:
            tok_cfg = dataclasses.replace(tok_cfg, vocab_size=auto_sizes(sizing_pairs).vocab_size)
        with _timed(seconds, "tokenizer"):
            tokenizer = tokenizer or _cached_tokenizer(raw["train"], tok_cfg, work)
        with _timed(seconds, "encode"):
            encoded = {name: encode(raw[name], tokenizer, work / f"{name}.encoded.arrow") for name in splits}
    if "train" in encoded:
        encoded["train"], clean_stats, long_kept = drop_long(encoded["train"], cfg.max_subwords, clean_stats)
        if len(split_stats["corpora"]) > 1:
            origin = np.searchsorted(np.cumsum(split_stats["corpora"]), kept[long_kept], side="right")
            encoded["train"], split_stats["corpora"] = mix(encoded["train"], origin, cfg)
    stats = {**split_stats, "clean": clean_stats, "cache": str(work), "sizing_pairs": sizing_pairs,
             "pairs": {name: len(ds) for name, ds in encoded.items()}, "seconds": seconds}
    return Corpus(encoded, tokenizer, stats)


@contextmanager
def _timed(seconds: dict, name: str):
    start = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - start, 3)


def train_specs(cfg: DataConfig) -> list[str]:
    """The training corpora: data.train as a list."""
    return [cfg.train] if isinstance(cfg.train, str) else list(cfg.train)


def mix(train: datasets.Dataset, origin: np.ndarray, cfg: DataConfig) -> tuple[datasets.Dataset, list[dict]]:
    """Each corpus's pairs `data.weights[i]` times per epoch (upsampling): whole copies, and for a fraction a
    sample drawn once with `data.split_seed`. `origin` (N,) is the corpus of each training pair."""
    weights = cfg.weights or [1.0] * len(train_specs(cfg))
    rng = np.random.default_rng(cfg.split_seed)
    parts, corpora = [], []
    for i, (spec, weight) in enumerate(zip(train_specs(cfg), weights)):
        idx = np.flatnonzero(origin == i)
        whole, frac = divmod(float(weight), 1.0)
        extra = np.sort(rng.choice(idx, size=round(frac * len(idx)), replace=False))
        parts += [idx] * int(whole) + [extra]
        corpora.append({"train": spec, "pairs": len(idx), "weight": weight, "per_epoch": int(whole) * len(idx) + len(extra)})
    return train.select(np.concatenate(parts)), corpora


def _read_splits(cfg: DataConfig, cache: Path) -> tuple[dict[str, datasets.Dataset], dict]:
    """train, valid and test: from their own specs, from the first train corpus's named splits, or carved off it.
    Further training corpora are appended to train; stats["corpora"] holds each one's pairs."""
    specs = train_specs(cfg)
    parts = [_read_train(spec, cfg, cache) for spec in specs]
    splits, carved = {"train": parts[0]}, []
    for name, spec, ratio in (("valid", cfg.valid, cfg.valid_ratio), ("test", cfg.test, cfg.test_ratio)):
        ds = load_split(spec, cfg, name, cache) if spec else load_split(specs[0], cfg, name, cache, whole_ok=False)
        if ds is None:
            if ratio <= 0:
                raise NmtError(f"config key 'data.{name}': no {name} set given and data.{name}_ratio is 0")
            splits["train"], ds = _carve(splits["train"], name, ratio, cfg.split_seed + len(carved))
            carved.append(name)
        splits[name] = ds
    for name, ds in splits.items():
        if len(ds) == 0:
            raise NmtError(f"the {name} split is empty (from {getattr(cfg, name) or specs[0]!r})")
    sizes = [len(splits["train"])] + [len(p) for p in parts[1:]]
    if len(parts) > 1:
        splits["train"] = datasets.concatenate_datasets([splits["train"], *parts[1:]])
    return splits, {"carved_from_train": carved, "corpora": sizes}


def _read_train(spec: str, cfg: DataConfig, cache: Path) -> datasets.Dataset:
    train = load_split(spec, cfg, "train", cache)
    if len(train) == 0:
        raise NmtError(f"no training pairs in {spec!r} (empty file?)")
    if cfg.max_train_pairs is not None:
        train = train.select(range(min(cfg.max_train_pairs, len(train))))
    return train


def _carve(train: datasets.Dataset, name: str, ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, the `name` split): a share `ratio` of train carved off, refused when either side would be empty."""
    try:
        parts = train.train_test_split(test_size=ratio, seed=seed)
    except ValueError:  # the splitter's "the resulting train set will be empty"
        raise NmtError(f"config key 'data.{name}': {len(train)} training pair(s) left are too few to carve a {name} set "
                       f"of data.{name}_ratio={ratio} from; give data.{name} (a separate file) or more pairs") from None
    return parts["train"], parts["test"]


def _content_key(raw: dict[str, datasets.Dataset], cfg: DataConfig, tok_cfg: TokenizerConfig,
                 tokenizer: PairTokenizer | None) -> str:
    h = hashlib.sha256()
    for name in SPLITS:
        h.update(f"{name}:{dataset_fingerprint(raw[name])}:{len(raw[name])};".encode())
    # BPE-dropout changes only the training pairs' per-epoch segmentation (DropoutEpochs), not what is cached here;
    # the mixing weights only select from the encoded pairs
    tok = to_dict(tok_cfg) | {"dropout": None}
    data = to_dict(cfg) | {"cache_dir": None, "weights": None, "shared_cache": None}
    h.update(json.dumps({"data": data, "tok": tok}, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(tokenizer.src.to_str().encode() + tokenizer.tgt.to_str().encode())
    return h.hexdigest()[:16]


def _cached_clean(raw: dict[str, datasets.Dataset], cfg: DataConfig,
                  work: Path) -> tuple[datasets.Dataset, dict, np.ndarray]:
    """The cleaned training split, the cleaning stats and the kept indices (into raw["train"])."""
    train, keep_file, stats_file = raw["train"], work / "train.keep.npy", work / "clean.json"
    if keep_file.is_file() and stats_file.is_file():
        keep, stats = np.load(keep_file), json.loads(stats_file.read_text())
    else:
        keep, stats = clean(train, cfg, {name: raw[name] for name in ("valid", "test")})
        if stats["kept"] == 0:
            raise NmtError(f"no training pairs left after cleaning ({stats['read']} read; dropped: "
                           f"{stats['dropped']}); check the files or relax data.max_words / data.max_ratio")
        # temporary names of our own: two runs may fill the same cache at once (the last rename wins)
        tmp = work / f".train.keep.{os.getpid()}.npy"
        np.save(tmp, keep)
        os.replace(tmp, keep_file)  # written before the stats, which mark the pair complete
        (work / f".clean.{os.getpid()}").write_text(json.dumps(stats))
        os.replace(work / f".clean.{os.getpid()}", stats_file)
    return (train.select(keep) if len(keep) < len(train) else train), stats, keep


def _cached_tokenizer(train: datasets.Dataset, tok_cfg: TokenizerConfig, work: Path) -> PairTokenizer:
    tok_dir = work / "tokenizer"
    if tok_dir.is_dir():
        return PairTokenizer.load(tok_dir)
    if tok_cfg.train_sample is not None and tok_cfg.train_sample < len(train):
        rng = np.random.default_rng(0)  # the same sample on every run and process
        train = train.select(np.sort(rng.choice(len(train), size=tok_cfg.train_sample, replace=False)))

    def texts(name: str) -> Callable[[], Iterator[list[str]]]:  # batches of one side, as tokenizers takes them
        return lambda: (t.column(name).to_pylist() for t in arrow_batches(train, 10_000))

    with bulk_threads():
        tokenizer = train_pair_tokenizer(texts("src"), texts("tgt"), tok_cfg, len(train))
    tmp = Path(tempfile.mkdtemp(dir=work, prefix=".tokenizer-"))
    tokenizer.save(tmp)
    try:
        os.replace(tmp, tok_dir)
    except OSError:  # another run filling the same cache got there first: use its (identical) tokenizer
        shutil.rmtree(tmp, ignore_errors=True)
        return PairTokenizer.load(tok_dir)
    return tokenizer


# --- BPE-dropout: the training split re-segmented each epoch ---------------------------------------


class DropoutEpochs:
    """The training split re-segmented with BPE-dropout (Provilkov et al. 2020) for every epoch.

    Pair i of epoch e is segmented by a generator seeded with (seed, e, i): an epoch's segmentation is the
    same on every process, in a resumed run and however the batches are cut, and differs between epochs.
    Each process encodes the epoch it is in by itself (no cache to share, nothing to wait for) and keeps
    that one; the lengths of the epochs seen are kept for batch planning. A pair whose noisy segmentation
    would be longer than `max_cost` keeps its deterministic one. Validation and test are never touched.
    """

    def __init__(self, train: datasets.Dataset, tokenizer: PairTokenizer, p: float, seed: int, max_cost: int):
        self.train, self.p, self.seed, self.max_cost = train, p, seed, max_cost
        self.segmenters = DropoutSegmenter(tokenizer.src, p), DropoutSegmenter(tokenizer.tgt, p)
        self._lengths: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._epoch: tuple[int, datasets.Dataset] | None = None

    def encoded(self, epoch: int) -> datasets.Dataset:
        """Columns src_ids and tgt_ids of `epoch`'s segmentation (in memory)."""
        if self._epoch is None or self._epoch[0] != epoch:
            ds = self.train.map(_dropout_batch, batched=True, batch_size=1000, with_indices=True, keep_in_memory=True,
                                fn_kwargs={"segmenters": self.segmenters, "epoch_seed": f"{self.seed}:{epoch}",
                                           "max_cost": self.max_cost},
                                new_fingerprint=f"{dataset_fingerprint(self.train)}-dropout-{self.p}-{self.seed}-{epoch}")
            self._epoch = epoch, ds.select_columns(["src_ids", "tgt_ids"])
            self._lengths[epoch] = column(ds, "cost").astype(np.int64), pair_lengths(ds)[0]
        return self._epoch[1]

    def lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(N,) padded cost and (N,) source length of every pair in `epoch`'s segmentation: what the batch
        sampler plans that epoch with (`TokenBatchSampler.epoch_lengths`)."""
        if epoch not in self._lengths:
            self.encoded(epoch)
        return self._lengths[epoch]

    def view(self, epoch: Callable[[], int]) -> EpochView:
        """A map-style dataset for a DataLoader, reading the epoch that `epoch()` names at each fetch."""
        return EpochView(self, epoch)


def bpe_dropout(cfg: TrainConfig, corpus: Corpus) -> DropoutEpochs | None:
    """The training pairs re-segmented each epoch when tokenizer.dropout is set; None when it is off."""
    if not cfg.tokenizer.dropout:
        return None
    return DropoutEpochs(corpus.splits["train"], corpus.tokenizer, cfg.tokenizer.dropout, cfg.seed,
                         max_cost=min(cfg.data.max_subwords, cfg.model.max_positions))


@dataclass
class EpochView:
    """DataLoader dataset over `DropoutEpochs`; `epoch` is the batch sampler's (read in the loading process,
    so the DataLoader must run without worker processes, as nmt.train's does)."""

    epochs: DropoutEpochs
    epoch: Callable[[], int]

    def __len__(self) -> int:
        return len(self.epochs.train)

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return self.epochs.encoded(self.epoch()).__getitems__(indices)

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]


def _dropout_batch(batch: dict, indices: list[int], segmenters: tuple[DropoutSegmenter, DropoutSegmenter],
                   epoch_seed: str, max_cost: int) -> dict:
    src_ids, tgt_ids, cost = [], [], []
    for i, src, tgt, plain_src, plain_tgt in zip(indices, batch["src"], batch["tgt"], batch["src_ids"], batch["tgt_ids"]):
        rng = random.Random(f"{epoch_seed}:{i}")  # str seeds hash with SHA-512: the same in every process
        s, t = segmenters[0].encode(src, rng) + [EOS], segmenters[1].encode(tgt, rng)
        if pair_cost(s, t) > max_cost:
            s, t = plain_src, plain_tgt
        src_ids.append(s)
        tgt_ids.append(t)
        cost.append(pair_cost(s, t))
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "cost": cost, "src_len": [len(s) for s in src_ids],
            "tgt_len": [len(t) + 1 for t in tgt_ids]}
