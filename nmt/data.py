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
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from nmt.compat import dataset_fingerprint
from nmt.config import BUILTIN, DataConfig, TokenizerConfig, TrainConfig, auto_sizes, to_dict
from nmt.errors import NmtError
from nmt.tokenizer import EOS, DropoutSegmenter, PairTokenizer, train_pair_tokenizer

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


def count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _decode(raw: bytes, path: Path, line_no: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NmtError(f"{path}:{line_no}: not valid UTF-8 (byte {e.start + 1} of the line); "
                       "convert the file, e.g. iconv -f latin1 -t utf-8") from None
    if line_no == 1:
        text = text.removeprefix("\ufeff")
    return text.rstrip("\r\n")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            yield i, _decode(raw, path, i)


def read_text_pair(src: str, tgt: str) -> Iterator[dict]:
    """Line i of `src` with line i of `tgt`."""
    src_path, tgt_path = Path(src), Path(tgt)
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise NmtError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; "
                       "line i of one must be the translation of line i of the other")
    for (_, a), (_, b) in zip(_lines(src_path), _lines(tgt_path)):
        yield {"src": a, "tgt": b}


def read_tsv(path: str) -> Iterator[dict]:
    """Column 1 is the source, column 2 the target; further columns (attribution) are ignored."""
    for i, line in _lines(Path(path)):
        cols = line.split("\t")
        if len(cols) < 2:
            raise NmtError(f"{path}:{i}: expected source<TAB>target, found {len(cols)} column; "
                           "fix or remove the line")
        yield {"src": cols[0], "tgt": cols[1]}


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
        return _from_generator(read_tsv, {"path": str(path), "stamp": _stamp(path)}, cache)
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
    return _from_generator(read_text_pair, {"src": str(src), "tgt": str(tgt),
                                            "stamp": _stamp(src) + _stamp(tgt)}, cache)


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


def clean(ds: datasets.Dataset, cfg: DataConfig) -> tuple[np.ndarray, dict]:
    """Indices of the pairs to keep (bad pairs and exact duplicates dropped), and counts per reason."""
    keep, counts, seen = [], Counter(), set()
    index = 0
    for batch in ds.iter(batch_size=10_000):
        for src, tgt in zip(batch["src"], batch["tgt"]):
            reason = drop_reason(src, tgt, cfg)
            if reason is None and cfg.dedupe:
                key = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=12).digest()
                reason = "duplicate" if key in seen else None
                seen.add(key)
            if reason:
                counts[reason] += 1
            else:
                keep.append(index)
            index += 1
    stats = {"read": index, "kept": len(keep), "dropped": dict(counts)}
    return np.asarray(keep, dtype=np.int64), stats


# --- encoding -----------------------------------------------------------------------------------


def _encode_batch(batch: dict, tokenizer: PairTokenizer) -> dict:
    src_ids = tokenizer.encode_src(batch["src"])
    tgt_ids = tokenizer.encode_tgt(batch["tgt"])
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "cost": [pair_cost(s, t) for s, t in zip(src_ids, tgt_ids)]}


def pair_cost(src_ids: list[int], tgt_ids: list[int]) -> int:
    """Padded tokens a pair needs: the decoder sees <s> + tgt and predicts tgt + </s>, len(tgt) + 1 positions."""
    return max(len(src_ids), len(tgt_ids) + 1)


def encode(ds: datasets.Dataset, tokenizer: PairTokenizer, cache_file: Path) -> datasets.Dataset:
    """Tokenize with Dataset.map(batched=True); a second call with the same cache file re-tokenizes nothing."""
    return ds.map(_encode_batch, batched=True, batch_size=1000, fn_kwargs={"tokenizer": tokenizer},
                  cache_file_name=str(cache_file), load_from_cache_file=True, new_fingerprint=cache_file.stem)


def pair_lengths(ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(N,) source lengths (subwords + </s>) and (N,) target lengths as the decoder sees them (+ </s>)."""
    table = ds.select_columns(["src_ids", "tgt_ids"]).with_format("arrow")[:]
    side = lambda name: pc.list_value_length(table.column(name)).to_numpy().astype(np.int64)
    return side("src_ids"), side("tgt_ids") + 1


def drop_long(train: datasets.Dataset, max_subwords: int, stats: dict) -> tuple[datasets.Dataset, dict]:
    """Drop training pairs longer than `max_subwords` subwords on either side, counting them."""
    cost = np.asarray(train["cost"])
    keep = np.flatnonzero(cost <= max_subwords)
    if len(keep) == len(cost):
        return train, stats
    if len(keep) == 0:
        raise NmtError(f"no training pairs left: all are longer than data.max_subwords={max_subwords}")
    dropped = {**stats["dropped"], "too_many_subwords": len(cost) - len(keep)}
    return train.select(keep), {**stats, "kept": len(keep), "dropped": dropped}


# --- the whole preparation -----------------------------------------------------------------------


def prepare(cfg: DataConfig, tok_cfg: TokenizerConfig, main_first: Callable[[], ContextManager] | None = None,
            tokenizer: PairTokenizer | None = None, splits: tuple[str, ...] = SPLITS) -> Corpus:
    """Read, carve, clean, train the tokenizer (unless given) and encode, all cached by content.

    `main_first` (e.g. accelerator.main_process_first) lets the main process fill the cache while the
    others wait and then read it. A null `tok_cfg.vocab_size` is chosen by `auto_sizes` from the number of
    training pairs left after cleaning, recorded as stats["sizing_pairs"].
    """
    from contextlib import nullcontext

    cache_root = Path(os.path.expanduser(cfg.cache_dir))
    cache_root.mkdir(parents=True, exist_ok=True)
    with (main_first or nullcontext)():
        raw, split_stats = _read_splits(cfg, cache_root)
        key = _content_key(raw, cfg, tok_cfg, tokenizer)
        work = cache_root / "prepared" / key
        work.mkdir(parents=True, exist_ok=True)
        raw["train"], clean_stats = _cached_clean(raw["train"], cfg, work)
        sizing_pairs = len(raw["train"])
        if tok_cfg.vocab_size is None:
            tok_cfg = dataclasses.replace(tok_cfg, vocab_size=auto_sizes(sizing_pairs).vocab_size)
        tokenizer = tokenizer or _cached_tokenizer(raw["train"], tok_cfg, work)
        encoded = {name: encode(raw[name], tokenizer, work / f"{name}.arrow") for name in splits}
    if "train" in encoded:
        encoded["train"], clean_stats = drop_long(encoded["train"], cfg.max_subwords, clean_stats)
    stats = {**split_stats, "clean": clean_stats, "cache": str(work), "sizing_pairs": sizing_pairs,
             "pairs": {name: len(ds) for name, ds in encoded.items()}}
    return Corpus(encoded, tokenizer, stats)


def _read_splits(cfg: DataConfig, cache: Path) -> tuple[dict[str, datasets.Dataset], dict]:
    """train, valid and test: from their own specs, from train's named splits, or carved off train."""
    train = load_split(cfg.train, cfg, "train", cache)
    if len(train) == 0:
        raise NmtError(f"no training pairs in {cfg.train!r} (empty file?)")
    if cfg.max_train_pairs is not None:
        train = train.select(range(min(cfg.max_train_pairs, len(train))))
    splits, carved = {"train": train}, []
    for name, spec, ratio in (("valid", cfg.valid, cfg.valid_ratio), ("test", cfg.test, cfg.test_ratio)):
        ds = load_split(spec, cfg, name, cache) if spec else load_split(cfg.train, cfg, name, cache, whole_ok=False)
        if ds is None:
            if ratio <= 0:
                raise NmtError(f"config key 'data.{name}': no {name} set given and data.{name}_ratio is 0")
            splits["train"], ds = _carve(splits["train"], name, ratio, cfg.split_seed + len(carved))
            carved.append(name)
        splits[name] = ds
    for name, ds in splits.items():
        if len(ds) == 0:
            raise NmtError(f"the {name} split is empty (from {getattr(cfg, name) or cfg.train!r})")
    return splits, {"carved_from_train": carved}


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
    # BPE-dropout changes only the training pairs' per-epoch segmentation (DropoutEpochs), not what is cached here
    tok = to_dict(tok_cfg) | {"dropout": None}
    h.update(json.dumps({"data": to_dict(cfg) | {"cache_dir": None}, "tok": tok}, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(tokenizer.src.to_str().encode() + tokenizer.tgt.to_str().encode())
    return h.hexdigest()[:16]


def _cached_clean(train: datasets.Dataset, cfg: DataConfig, work: Path) -> tuple[datasets.Dataset, dict]:
    keep_file, stats_file = work / "train.keep.npy", work / "clean.json"
    if keep_file.is_file() and stats_file.is_file():
        keep, stats = np.load(keep_file), json.loads(stats_file.read_text())
    else:
        keep, stats = clean(train, cfg)
        if stats["kept"] == 0:
            raise NmtError(f"no training pairs left after cleaning ({stats['read']} read; dropped: "
                           f"{stats['dropped']}); check the files or relax data.max_words / data.max_ratio")
        # temporary names of our own: two runs may fill the same cache at once (the last rename wins)
        tmp = work / f".train.keep.{os.getpid()}.npy"
        np.save(tmp, keep)
        os.replace(tmp, keep_file)  # written before the stats, which mark the pair complete
        (work / f".clean.{os.getpid()}").write_text(json.dumps(stats))
        os.replace(work / f".clean.{os.getpid()}", stats_file)
    return (train.select(keep) if len(keep) < len(train) else train), stats


def _cached_tokenizer(train: datasets.Dataset, tok_cfg: TokenizerConfig, work: Path) -> PairTokenizer:
    tok_dir = work / "tokenizer"
    if tok_dir.is_dir():
        return PairTokenizer.load(tok_dir)

    def column(name: str) -> Callable[[], Iterator[str]]:
        return lambda: (text for batch in train.iter(batch_size=10_000) for text in batch[name])

    tokenizer = train_pair_tokenizer(column("src"), column("tgt"), tok_cfg, len(train))
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
            self._lengths[epoch] = np.asarray(ds["cost"], dtype=np.int64), pair_lengths(ds)[0]
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
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "cost": cost}
